"""Use functrans' partitioner under torch.compile: code with graph breaks still gets min-cut
partitions on every captured graph."""

import torch

import functrans as ft


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def step(x):
        h = model[0](x)
        torch._dynamo.graph_break()  # e.g. a print or a data-dependent branch
        return model[2](model[1](h)).pow(2).mean()

    compiled = torch.compile(step, backend=ft.dynamo_backend(partition="min_cut"), dynamic=False)
    x = torch.randn(8, 16)
    loss = compiled(x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    step(x).backward()
    for got, want in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want)
    print(f"loss {loss.item():.4f}; gradients match eager through 2 captured graphs")


if __name__ == "__main__":
    main()
