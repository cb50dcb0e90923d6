#!/usr/bin/env python3
"""Make `policies/profiles/gpt2.json`: GPT-2 small, per module, in forward order.

    .venv/bin/python scripts/profile_gpt2.py [--out policies/profiles/gpt2.json]

The model is written out here in plain torch, module for module as Hugging
Face's `GPT2LMHeadModel` with the default `GPT2Config` (12 layers, width 768,
12 heads, vocabulary 50,257, context 1,024; the LM head's weight tied to the
token embedding): the same qualified names, parameter shapes and counts
(124,439,808). HF's `Conv1D` is a linear layer with its weight stored
transposed, so it is an `nn.Linear` here: same parameters, same FLOPs.

Fields and conventions are those of the other profiles (see the README next
to them): modules that own parameters or do FLOP-counted work, in the order
the forward pass first reaches them; a module's own FLOPs, children
excluded, from `torch.utils.flop_counter.FlopCounterMode` (matmuls; a
multiply-add counts 2; element-wise work counts 0), for one sample: one
sequence of 1,024 tokens. A tied parameter is owned by its first user in
forward order (the token embedding); the LM head then owns nothing but does
the largest matmul.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS = 50257, 1024, 768, 12, 12


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            z.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2)
            for z in self.c_attn(x).split(WIDTH, dim=2)
        )
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(WIDTH // HEADS)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(b, t, WIDTH)
        return self.c_proj(y)  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.c_proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)  # type: ignore[no-any-return]


class GPT2LMHeadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = Transformer()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(tokens))  # type: ignore[no-any-return]


def profile() -> dict[str, object]:
    with torch.device("meta"):  # shapes only: counting FLOPs needs no arithmetic
        model = GPT2LMHeadModel()
    names = {m: n for n, m in model.named_modules() if n}
    order: list[nn.Module] = []

    def first_use(module: nn.Module, _args: object) -> None:
        if module not in order:
            order.append(module)

    hooks = [m.register_forward_pre_hook(first_use) for m in names]
    tokens = torch.zeros(1, CONTEXT, dtype=torch.long, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    counts = counter.get_flop_counts()  # per module path under the root's class, children included
    total_of = {n: sum(counts.get(f"{type(model).__name__}.{n}", {}).values())
                for n in names.values()}
    ran = set(order)

    def called_children(m: nn.Module) -> list[nn.Module]:  # through containers never called
        return [d for c in m.children()
                for d in ([c] if c in ran else called_children(c))]

    owner: dict[int, nn.Module] = {}
    for m in order:  # a tied parameter belongs to its first user in forward order
        for p in m.parameters(recurse=False):
            owner.setdefault(id(p), m)
    rows: list[dict[str, object]] = []
    for m in order:
        own = total_of[names[m]] - sum(total_of[names[c]] for c in called_children(m))
        params = sum(p.numel() for p in m.parameters(recurse=False) if owner[id(p)] is m)
        if params or own:
            rows.append({"index": len(rows), "module": names[m], "kind": type(m).__name__,
                         "params": params, "bytes_fp32": 4 * params, "forward_flops": int(own)})
    total_params = sum(p.numel() for p in model.parameters())
    total_flops = sum(counts["Global"].values())
    assert sum(int(str(r["forward_flops"])) for r in rows) == total_flops, total_flops
    assert sum(r["params"] for r in rows) == total_params == 124_439_808, total_params
    return {
        "model": "gpt2",
        "note": "GPT-2 small as Hugging Face's GPT2LMHeadModel with the default GPT2Config "
                "(written out in plain torch by scripts/profile_gpt2.py, Conv1D as Linear); one "
                "sequence of 1024 tokens; forward FLOPs; the LM head's weight tied to the token "
                "embedding is counted once, at the embedding",
        "total_params": total_params,
        "total_bytes_fp32": 4 * total_params,
        "total_forward_flops": total_flops,
        "modules_in_forward_order": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("policies/profiles/gpt2.json"))
    args = ap.parse_args()
    data = profile()
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"{args.out}: {data['total_params']:,} params, "
          f"{data['total_forward_flops'] / 1e9:.1f} GFLOP per sequence, "
          f"{len(data['modules_in_forward_order'])} modules")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
