"""The IR and the words every layer speaks: graphs, tags, errors, pytrees, op classes."""
