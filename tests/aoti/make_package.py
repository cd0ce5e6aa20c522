"""Exports a small attention block that uses rotary.RotaryEmbedding, packages
it with AOTInductor (CPU) and writes its inputs and eager output next to it,
for the C++ program in this directory (main.cpp).

    python tests/aoti/make_package.py OUT_DIR

OUT_DIR/block.pt2      the AOTInductor package
OUT_DIR/tensors.txt    one line per tensor: name dtype size...
OUT_DIR/<name>.bin     its raw little-endian data (x, position_ids, expected)
"""

import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

import rotary


class AttentionBlock(nn.Module):
    """GQA self-attention with rotary q/k at absolute position ids."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=16, max_seq_len=64):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(heads * head_dim, hidden, bias=False)
        self.rope = rotary.RotaryEmbedding(head_dim, max_seq_len, interleaved=False)

    def forward(self, x, position_ids):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, k, position_ids=position_ids)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    block = AttentionBlock().eval()
    x = torch.randn(2, 8, 64)
    # Left-padded style ids: row 1 starts later, both reach past the first rows.
    position_ids = torch.stack([torch.arange(8), torch.arange(8) + 21])
    with torch.no_grad():
        expected = block(x, position_ids)
        program = torch.export.export(block, (x, position_ids))
        torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(out_dir, "block.pt2"))
    with open(os.path.join(out_dir, "tensors.txt"), "w") as f:
        for name, t in (("x", x), ("position_ids", position_ids), ("expected", expected)):
            t.contiguous().numpy().tofile(os.path.join(out_dir, name + ".bin"))
            f.write(" ".join([name, str(t.dtype).replace("torch.", "")] + [str(n) for n in t.shape]) + "\n")
    print(f"make_package: wrote {out_dir}/block.pt2 and its inputs")


if __name__ == "__main__":
    main(sys.argv[1])
