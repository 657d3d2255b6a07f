"""Would a plain int8 GEMM (`torch._int_mm`) do for large steps? Its agreement with float32.

On CPUs with AVX512-VNNI or AMX, `torch._int_mm` multiplies int8 matrices at about twice
the rate of bfloat16 `torch.mm` (benchmarks/ceilings.py), which is how OpenVINO GenAI
prefills faster than a dense bfloat16 GEMM can. A whole-K integer product needs one scale
per activation row and one per weight row ("W8A8": activations quantised per token,
weights per output channel). The GGUF file's weights carry one scale per group of 32
inputs, so they must be rounded again to fit; this script measures what that costs before
anyone builds it. Teacher-forced over the same sequences (`prompt_logprobs`, one engine
step per sequence: every step takes the large-step path), against the float32 engine:

- `bf16`: the default bfloat16 engine (on AVX-512/AVX2, every step through the file's own
  blocks with activations rounded to int8 per group of 32: the VNNI GEMM);
- `bf16-dense`: bfloat16 with `quant_max_tokens=32`, so steps of more rows take the dense
  bf16 weights (the default on AVX-512 before the int8 GEMM);
- `w8`: those large steps with the weights rounded to int8 per output row, float
  activations (the weights' share of the error);
- `w8a8`: those large steps through `torch._int_mm`, activations rounded to int8 per row
  too.

For each: how often the most likely next token agrees with float32's, and |delta log p|
of float32's most likely token. A prototype (Linear.forward patched here), not an engine
path.

    .venv/bin/python benchmarks/bench_w8a8_agreement.py [--num-prompts 32] [--max-len 384]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _patch_large_steps(model, mode: str) -> None:
    """Large steps (> quant_max_tokens rows) of every Linear through int8 weights."""
    import torch

    from pagedinfer.model.linear import Linear

    for m in model.modules():
        if isinstance(m, Linear):
            w = m.weight.to_dense() if m.weight.is_mkldnn else m.weight
            wf = w.float()
            scale = wf.abs().amax(1).clamp_min(1e-12) / 127
            m._w8_t = (wf / scale[:, None]).round().clamp(-127, 127).to(torch.int8).t()
            m._w8_scale = scale
    dense = Linear.forward

    def forward(self, x):
        if x.shape[0] <= self.quant_max_rows or not hasattr(self, "_w8_t"):
            return dense(self, x)
        if mode == "w8":
            out = x.float() @ (self._w8_t.float() * self._w8_scale)
        else:
            xf = x.float()
            xs = xf.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
            xq = (xf / xs).round_().to(torch.int8)
            out = torch._int_mm(xq, self._w8_t).float() * xs * self._w8_scale
        out = out.to(x.dtype)
        return out if self.bias is None else out.add_(self.bias)

    Linear.forward = forward


def _score(args, mode: str, out_path: str) -> None:
    """One engine (a fresh process per mode): top-5 prompt logprobs of every sequence."""
    from benchmarks import workload
    from pagedinfer import LLM, SamplingParams

    encode = workload.load_encoder(None)
    dataset = args.dataset_path or workload.DEFAULT_DATASET
    data = workload.build(encode, args.num_prompts * 2, 0, dataset)
    seqs = [r["prompt_token_ids"][: args.max_len] for r in data["requests"]]
    seqs = [s for s in seqs if len(s) > 64][: args.num_prompts]
    llm = LLM(
        None, dtype="float32" if mode == "fp32" else "bfloat16", enable_prefix_caching=False,
        max_num_batched_tokens=2048, max_model_len=2048, log_stats_interval_s=0,
        quant_max_tokens=None if mode in ("fp32", "bf16") else 32,
    )  # fmt: skip
    if mode in ("w8", "w8a8"):
        _patch_large_steps(llm.llm_engine.engine_core.executor.worker.model, mode)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    scored = [
        [{t: lp.logprob for t, lp in (pos or {}).items()} for pos in o.prompt_logprobs[1:]]
        for o in outs
    ]
    with open(out_path, "w") as f:
        json.dump([[list(p.items()) for p in r] for r in scored], f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=384)
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--mode", default=None, help=argparse.SUPPRESS)  # a child's mode
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        _score(args, args.mode, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for mode in ("fp32", "bf16", "bf16-dense", "w8", "w8a8"):
            path = os.path.join(tmp, f"{mode}.json")
            argv = [sys.executable, __file__, "--mode", mode, "--out", path, "--num-prompts",
                    str(args.num_prompts), "--max-len", str(args.max_len)]  # fmt: skip
            if args.dataset_path:
                argv += ["--dataset-path", args.dataset_path]
            subprocess.run(argv, check=True)
            with open(path) as f:
                results[mode] = json.load(f)
    from benchmarks.bench_kv_cache_dtype import logprob_agreement

    for mode in ("bf16", "bf16-dense", "w8", "w8a8"):
        pairs = (
            (dict(ref_pos), dict(pos))
            for ref_seq, seq in zip(results["fp32"], results[mode], strict=True)
            for ref_pos, pos in zip(ref_seq, seq, strict=True)
        )
        print(json.dumps({"mode": mode, **logprob_agreement(pairs)}))


if __name__ == "__main__":
    main()
