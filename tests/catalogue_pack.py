"""Bad-input cases: packing (pack.py and the pack raw ops)."""
import torch

import packcuda
from catalogue import Case, call

ops = torch.ops.packcuda

CASES = [
    Case("packcuda.gather_rows", "index_out_of_range",
         lambda: call(packcuda.gather_rows, torch.zeros(3, 2), torch.tensor([5])), arg="index"),
    Case("packcuda.gather_rows", "empty_transposed_src_bad_index", risky=True, arg="index",
         make=lambda: call(packcuda.gather_rows, torch.empty(0, 2, 0).transpose(0, 2), torch.tensor([3]), dim=-1)),
    Case("ops.gather_rows", "index_out_of_range",
         lambda: call(ops.gather_rows, torch.zeros(3, 2), torch.tensor([5]), 0.0, 0), arg="index"),
]
