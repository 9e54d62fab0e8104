"""grad/vjp, jvp/vmap, custom rules, remat and the plans they leave each other."""
