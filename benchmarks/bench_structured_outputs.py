"""Guided decoding benchmarks (issue #5): the throughput cost of a JSON schema, and grammar
compile times, for each structured-output backend.

Usage:

    .venv/bin/python benchmarks/bench_structured_outputs.py                  # both modes
    .venv/bin/python benchmarks/bench_structured_outputs.py --mode throughput \\
        [--backends xgrammar,guidance] [--repeats 3] [--max-tokens 256] [--dtype bfloat16]
    .venv/bin/python benchmarks/bench_structured_outputs.py --mode compile \\
        [--schemas tests/integration/data/json_schemas.json] [--compile-repeats 1]
    ... --out results.json                                                   # every figure

Modes:

  throughput  One engine per backend (built afresh, one alive at a time). 32 chat prompts
              asking for a JSON object, all submitted at once (temperature 0.7, request i
              seeded with seed + i), run (a) guided by one schema (nested object, array,
              enum, bounded strings, additionalProperties false) with max_tokens=M, and (b)
              unconstrained with ignore_eos and, per prompt, max_tokens = the number of tokens
              the latest guided run generated for it, so both runs generate the same tokens
              per request (and the batch shrinks the same way; the table shows both totals).
              Warm-up: a guided run (compiles the schema), a second guided run (cache hit; its
              counts are the first to match) and an unconstrained one; then --repeats rounds,
              alternating which run goes first. The prefix cache is reset before every run.
              Per round: output tok/s of each run, their ratio (guided / unconstrained; goal
              >= 0.85), the mask's time per step = delta bitmask_time_s / delta bitmask_steps
              over the guided run, and its share of that run's wall time. With --breakdown
              (default on) the time spent applying the mask to the logits, advancing the
              grammars (`accept_token`) and in the front end (`input_processor.process`, which
              validates the spec) is measured as well, by wrapping those functions.
  compile     For every schema of the corpus (a JSON list of {"name", "prompt",
              "schema"}) and each backend: compile on a FRESH backend (`create_backend(
              name, tokenizer, vocab_size=49152)`, so no cache hit; num_compiles is
              checked), then fill the first bitmask row (llguidance builds much of its lexer
              state lazily, so compile alone can undersell what a request waits for), then
              compile again (a cache hit). Median, p90, p99 and max in ms. A warm-up compile
              on a separate backend comes first.

Markdown tables (ready for docs/benchmarks.md) go to stdout, progress to stderr. Same-run
ratios are what to compare: this machine is noisy (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_SCHEMAS = os.path.join(ROOT, "tests", "integration", "data", "json_schemas.json")
BACKENDS = ("xgrammar", "guidance")
NUM_PROMPTS = 32
VOCAB_SIZE = 49152  # SmolLM2's LM head rows

# The throughput run's schema: a person's profile (nested object, array, enum, bounded
# strings, bounded integer, boolean; additionalProperties false everywhere).
THROUGHPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "designer", "manager", "scientist", "teacher", "artist"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 30},
                "country": {"type": "string", "minLength": 1, "maxLength": 30},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 24},
            "minItems": 1,
            "maxItems": 4,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "skills", "active"],
    "additionalProperties": False,
}

_ROLES = ["engineer", "designer", "manager", "scientist", "teacher", "artist", "nurse", "chef"]
_CITIES = ["Lisbon", "Osaka", "Nairobi", "Toronto"]


def throughput_prompts() -> list[str]:
    """32 distinct requests for the profile above (8 roles x 4 cities)."""
    return [
        f"Invent a {role} who lives in {city}. Reply with only a JSON object with the keys "
        "name, age, role, address (an object with city and country), skills (a list of "
        "strings) and active (true or false)."
        for role in _ROLES
        for city in _CITIES
    ][:NUM_PROMPTS]


def log(*args: object) -> None:
    print(*args, file=sys.stderr, flush=True)


def now_str() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --------------------------------------------------------------------------- throughput


class Timers:
    """Wall time and call counts of wrapped functions (the --breakdown)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> bool:
        """Replace `owner.attr` by a timed wrapper; False if there is none. `owner` is a class
        that defines `attr` itself (a function or a staticmethod) or an instance (then only
        that instance is wrapped)."""
        if isinstance(owner, type):
            raw = owner.__dict__.get(attr)
            if raw is None:
                return False
            static = isinstance(raw, staticmethod)
            func = raw.__func__ if static else raw
        else:
            func = getattr(owner, attr, None)
            if func is None:
                return False
            static = False
            raw = None

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, attr, staticmethod(timed) if static else timed)
        if raw is not None:
            self._undo.append(lambda: setattr(owner, attr, raw))
        else:
            self._undo.append(lambda: delattr(owner, attr))
        return True

    def snapshot(self) -> dict[str, tuple[float, int]]:
        return {k: (self.seconds[k], self.calls.get(k, 0)) for k in self.seconds}

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def install_breakdown(llm: Any) -> Timers:
    timers = Timers()
    engine = llm.llm_engine
    timers.wrap(engine, "step", "engine_step")
    timers.wrap(engine.input_processor, "process", "front_end_process")
    try:
        from pagedinfer.structured_output.manager import StructuredOutputManager

        timers.wrap(StructuredOutputManager, "accept_token", "grammar_accept")
    except ImportError:
        pass
    try:
        from pagedinfer.worker import model_runner

        for obj in vars(model_runner).values():
            if isinstance(obj, type) and "_apply_grammar_bitmask" in vars(obj):
                timers.wrap(obj, "_apply_grammar_bitmask", "mask_apply")
    except ImportError:
        pass
    return timers


def chat_prompts(llm: Any, texts: list[str]) -> list[dict[str, list[int]]]:
    tokenizer = llm.get_tokenizer()
    return [
        {
            "prompt_token_ids": tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
        }
        for text in texts
    ]


def timed_generate(
    llm: Any, prompts: list[dict], params: list[Any], timers: Timers | None
) -> dict[str, Any]:
    """One run: prefix cache reset, then llm.generate; wall time, tokens, stat deltas."""
    if not llm.reset_prefix_cache():
        log("warning: prefix cache not reset")
    gc.collect()
    before = llm.get_stats()
    t_before = timers.snapshot() if timers else {}
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.get_stats()
    t_after = timers.snapshot() if timers else {}
    counts = [len(o.outputs[0].token_ids) for o in outs]
    delta = {
        k: after[k] - before.get(k, 0)
        for k in ("bitmask_time_s", "bitmask_steps", "grammar_compiles", "grammar_cache_hits")
        if k in after
    }
    breakdown = {
        k: {"s": s - t_before.get(k, (0.0, 0))[0], "calls": c - t_before.get(k, (0.0, 0))[1]}
        for k, (s, c) in t_after.items()
    }
    return {
        "wall_s": wall,
        "output_tokens": sum(counts),
        "tok_s": sum(counts) / wall,
        "counts": counts,
        "texts": [o.outputs[0].text for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "stats_delta": delta,
        "breakdown": breakdown,
        "loadavg_1min_after": os.getloadavg()[0],
    }


def json_validity(texts: list[str], schema: dict[str, Any]) -> dict[str, int]:
    """How many outputs parse as JSON, and (with the jsonschema package) match the schema."""
    parsed = 0
    valid: int | None = None
    try:
        import jsonschema

        validator = jsonschema.Draft202012Validator(schema)
        valid = 0
    except ImportError:
        validator = None
    for text in texts:
        try:
            obj = json.loads(text)
        except ValueError:
            continue
        parsed += 1
        if validator is not None and validator.is_valid(obj):
            valid += 1  # type: ignore[operator]
    out = {"parsed_json": parsed}
    if valid is not None:
        out["schema_valid"] = valid
    return out


def throughput_backend(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    from pagedinfer import LLM, SamplingParams, StructuredOutputsParams

    log(f"[{now_str()}] throughput/{backend}: building the engine")
    t0 = time.perf_counter()
    llm = LLM(dtype=args.dtype, structured_outputs_backend=backend, log_stats_interval_s=0)
    load_s = time.perf_counter() - t0
    timers = install_breakdown(llm) if args.breakdown else None
    try:
        prompts = chat_prompts(llm, throughput_prompts())

        def guided_params() -> list[Any]:
            return [
                SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    seed=args.seed + i,
                    structured_outputs=StructuredOutputsParams(json=THROUGHPUT_SCHEMA),
                )
                for i in range(len(prompts))
            ]

        def plain_params(counts: list[int]) -> list[Any]:
            return [
                SamplingParams(
                    max_tokens=n,
                    temperature=args.temperature,
                    seed=args.seed + i,
                    ignore_eos=True,
                )
                for i, n in enumerate(counts)
            ]

        log(f"[{now_str()}] throughput/{backend}: warm-up (the guided run compiles the schema)")
        warm_compile = timed_generate(llm, prompts, guided_params(), timers)
        # A second guided warm-up on the cached schema: its counts are the ones to match
        # (in the first, requests become ready as the compile ends, so the batches differ).
        warm_guided = timed_generate(llm, prompts, guided_params(), timers)
        counts = warm_guided["counts"]
        warm_plain = timed_generate(llm, prompts, plain_params(counts), timers)
        log(
            f"  warm-up guided {warm_compile['wall_s']:.2f} s (compiles "
            f"{warm_compile['stats_delta'].get('grammar_compiles')}), cached "
            f"{warm_guided['wall_s']:.2f} s ({warm_guided['output_tokens']} tok), "
            f"unconstrained {warm_plain['wall_s']:.2f} s ({warm_plain['output_tokens']} tok)"
        )
        rounds = []
        for r in range(args.repeats):
            order = ("guided", "unconstrained") if r % 2 == 0 else ("unconstrained", "guided")
            runs: dict[str, dict[str, Any]] = {}
            for kind in order:
                if kind == "guided":
                    runs[kind] = timed_generate(llm, prompts, guided_params(), timers)
                else:
                    # The counts of the latest guided run (this round's if it went first).
                    runs[kind] = timed_generate(llm, prompts, plain_params(counts), timers)
                    runs[kind]["matched_counts"] = counts
                if kind == "guided" and runs[kind]["counts"] != counts:
                    log(
                        f"  note: guided counts changed ({sum(counts)} -> "
                        f"{runs[kind]['output_tokens']} tokens)"
                    )
                    counts = runs[kind]["counts"]
            g, u = runs["guided"], runs["unconstrained"]
            d = g["stats_delta"]
            steps = d.get("bitmask_steps", 0)
            mask_s = d.get("bitmask_time_s", 0.0)
            row = {
                "round": r + 1,
                "order": "/".join(order),
                "guided": _summary(g),
                "unconstrained": _summary(u),
                "ratio": g["tok_s"] / u["tok_s"],
                "mask_ms_per_step": 1e3 * mask_s / steps if steps else float("nan"),
                "mask_us_per_token": 1e6 * mask_s / g["output_tokens"],
                "mask_share_of_guided_wall": mask_s / g["wall_s"],
                "bitmask_steps": steps,
                "bitmask_time_s": mask_s,
                "same_counts": g["counts"] == u["matched_counts"],
                "guided_finish_reasons": _tally(g["finish_reasons"]),
                "guided_json": json_validity(g["texts"], THROUGHPUT_SCHEMA),
                "grammar_compiles_delta": d.get("grammar_compiles"),
                "grammar_cache_hits_delta": d.get("grammar_cache_hits"),
            }
            rounds.append(row)
            log(
                f"  round {r + 1} ({row['order']}): guided {g['tok_s']:.1f} tok/s "
                f"({g['wall_s']:.2f} s), unconstrained {u['tok_s']:.1f} tok/s "
                f"({u['wall_s']:.2f} s), ratio {row['ratio']:.3f}, mask "
                f"{row['mask_ms_per_step']:.3f} ms/step "
                f"({100 * row['mask_share_of_guided_wall']:.1f}% of guided wall), load "
                f"{os.getloadavg()[0]:.2f}"
            )
        sample = warm_guided["texts"][0]
        return {
            "backend": backend,
            "dtype": args.dtype,
            "load_s": load_s,
            "prompts": len(prompts),
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "guided_counts": counts,
            "warmup": {
                "guided_compile": _summary(warm_compile),
                "guided": _summary(warm_guided),
                "unconstrained": _summary(warm_plain),
            },
            "rounds": rounds,
            "median_ratio": statistics.median(r["ratio"] for r in rounds) if rounds else None,
            "median_mask_ms_per_step": (
                statistics.median(r["mask_ms_per_step"] for r in rounds) if rounds else None
            ),
            "sample_output": sample,
        }
    finally:
        if timers is not None:
            timers.restore()
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception as exc:  # noqa: BLE001
                log(f"  engine shutdown: {type(exc).__name__}: {exc}")
        del llm
        gc.collect()


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "wall_s": run["wall_s"],
        "output_tokens": run["output_tokens"],
        "tok_s": run["tok_s"],
        "stats_delta": run["stats_delta"],
        "breakdown": run["breakdown"],
        "loadavg_1min_after": run["loadavg_1min_after"],
    }


def _tally(values: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def throughput_tables(results: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | round | order | output tokens (guided / unconstrained) | guided out tok/s "
        "| unconstrained out tok/s | ratio | mask ms/step | mask us/token "
        "| mask share of guided wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rounds"]:
            lines.append(
                f"| {res['backend']} | {r['round']} | {r['order']} "
                f"| {r['guided']['output_tokens']} / {r['unconstrained']['output_tokens']} "
                f"| {r['guided']['tok_s']:.1f} | {r['unconstrained']['tok_s']:.1f} "
                f"| {r['ratio']:.3f} | {r['mask_ms_per_step']:.3f} | {r['mask_us_per_token']:.1f} "
                f"| {100 * r['mask_share_of_guided_wall']:.1f}% |"
            )
    lines.append("")
    lines.append(
        "| backend | guided tokens per request (min-max) | guided finish reasons "
        "| valid JSON (schema) "
        "| median ratio | median mask ms/step |"
    )
    lines.append("|---|---|---|---|---|---|")
    for res in results:
        if not res["rounds"]:
            continue
        last = res["rounds"][-1]
        js = last["guided_json"]
        valid = f"{js['parsed_json']}/{res['prompts']}"
        if "schema_valid" in js:
            valid += f" ({js['schema_valid']}/{res['prompts']})"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(last["guided_finish_reasons"].items()))
        lines.append(
            f"| {res['backend']} | {min(res['guided_counts'])}-{max(res['guided_counts'])} "
            f"| {reasons} | {valid} "
            f"| {res['median_ratio']:.3f} | {res['median_mask_ms_per_step']:.3f} |"
        )
    if any(r["rounds"] and r["rounds"][0]["guided"]["breakdown"] for r in results):
        lines.append("")
        lines.append("Where the guided run's extra time goes (mean over rounds, seconds per run):")
        lines.append("")
        lines.append(
            "| backend | guided wall | unconstrained wall | difference | mask fill "
            "| mask apply | grammar accept | front end (guided - unconstrained) "
            "| engine steps (guided / unconstrained) |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for res in results:
            rounds = res["rounds"]
            if not rounds:
                continue

            def mean(f: Callable[[dict[str, Any]], float], rounds=rounds) -> float:
                return statistics.fmean(f(r) for r in rounds)

            def part(side: str, key: str, what: str = "s") -> Callable[[dict], float]:
                return lambda r: r[side]["breakdown"].get(key, {}).get(what, 0.0)

            gw = mean(lambda r: r["guided"]["wall_s"])
            uw = mean(lambda r: r["unconstrained"]["wall_s"])
            fe = mean(part("guided", "front_end_process")) - mean(
                part("unconstrained", "front_end_process")
            )
            lines.append(
                f"| {res['backend']} | {gw:.3f} | {uw:.3f} | {gw - uw:+.3f} "
                f"| {mean(lambda r: r['bitmask_time_s']):.3f} "
                f"| {mean(part('guided', 'mask_apply')):.3f} "
                f"| {mean(part('guided', 'grammar_accept')):.3f} | {fe:+.3f} "
                f"| {mean(part('guided', 'engine_step', 'calls')):.0f} / "
                f"{mean(part('unconstrained', 'engine_step', 'calls')):.0f} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ compile


def load_schemas(path: str) -> tuple[list[dict[str, Any]], str]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list) or not all(isinstance(d, dict) and "schema" in d for d in data):
        raise SystemExit(f"{path}: expected a JSON list of {{name, prompt, schema}}")
    return data, os.path.relpath(path, ROOT) if path.startswith(ROOT) else path


def compile_backend(backend: str, schemas: list[dict[str, Any]], args: argparse.Namespace):
    from pagedinfer.structured_output import StructuredOutputOptions, canonical_spec, create_backend
    from pagedinfer.tokenizer import Tokenizer

    json_kind = StructuredOutputOptions.JSON
    tokenizer = Tokenizer.from_model_path(None)
    log(f"[{now_str()}] compile/{backend}: warm-up")
    t0 = time.perf_counter()
    warm = create_backend(backend, tokenizer, vocab_size=VOCAB_SIZE)  # type: ignore[arg-type]
    first_backend_s = time.perf_counter() - t0
    g = warm.compile_grammar(json_kind, canonical_spec(json_kind, THROUGHPUT_SCHEMA))
    g.fill_bitmask(warm.allocate_token_bitmask(1), 0)
    warm.destroy()
    del warm, g

    per_schema = []
    for i, item in enumerate(schemas):
        name = item.get("name", f"#{i}")
        spec = canonical_spec(json_kind, item["schema"])
        samples: dict[str, list[float]] = {"compile": [], "first_mask": [], "cached": []}
        new_backend: list[float] = []
        error = None
        for _ in range(args.compile_repeats):
            t0 = time.perf_counter()
            b = create_backend(backend, tokenizer, vocab_size=VOCAB_SIZE)  # type: ignore[arg-type]
            new_backend.append(time.perf_counter() - t0)
            mask = b.allocate_token_bitmask(1)
            compiles, hits = b.num_compiles, b.num_cache_hits
            try:
                t0 = time.perf_counter()
                grammar = b.compile_grammar(json_kind, spec)
                t1 = time.perf_counter()
                grammar.fill_bitmask(mask, 0)
                t2 = time.perf_counter()
            except ValueError as exc:
                error = f"{type(exc).__name__}: {exc}"
                b.destroy()
                break
            if b.num_compiles != compiles + 1 or b.num_cache_hits != hits:
                raise SystemExit(f"{backend}/{name}: the first compile was not a fresh compile")
            t3 = time.perf_counter()
            b.compile_grammar(json_kind, spec)
            t4 = time.perf_counter()
            if b.num_cache_hits != hits + 1:
                log(f"  {backend}/{name}: the second compile was not a cache hit")
            samples["compile"].append(t1 - t0)
            samples["first_mask"].append(t2 - t0)
            samples["cached"].append(t4 - t3)
            b.destroy()
            del b, grammar
        row: dict[str, Any] = {"name": name, "spec_chars": len(spec)}
        if error is not None:
            row["error"] = error[:300]
            log(f"  {backend}/{name}: {row['error']}")
        else:
            for k, v in samples.items():
                row[f"{k}_ms"] = 1e3 * statistics.median(v)
            row["new_backend_ms"] = 1e3 * statistics.median(new_backend)
        per_schema.append(row)
    gc.collect()

    ok = [r for r in per_schema if "error" not in r]

    def dist(key: str) -> dict[str, float]:
        xs = [r[key] for r in ok]
        if not xs:
            return {}
        return {
            "median": statistics.median(xs),
            "p90": percentile(xs, 90),
            "p99": percentile(xs, 99),
            "max": max(xs),
            "mean": statistics.fmean(xs),
        }

    slowest = sorted(ok, key=lambda r: r["first_mask_ms"], reverse=True)[:3]
    return {
        "backend": backend,
        "schemas": len(schemas),
        "compiled": len(ok),
        "failed": [{"name": r["name"], "error": r["error"]} for r in per_schema if "error" in r],
        "first_backend_s": first_backend_s,
        "compile_ms": dist("compile_ms"),
        "compile_plus_first_mask_ms": dist("first_mask_ms"),
        "cached_compile_ms": dist("cached_ms"),
        "new_backend_ms": dist("new_backend_ms"),
        "slowest": [(r["name"], round(r["first_mask_ms"], 2)) for r in slowest],
        "per_schema": per_schema,
    }


def compile_tables(results: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | schemas compiled | compile median ms | p90 | p99 | max "
        "| compile + first mask median ms | p99 | cached compile median ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        c, f, k = res["compile_ms"], res["compile_plus_first_mask_ms"], res["cached_compile_ms"]
        if not c:
            lines.append(f"| {res['backend']} | 0/{res['schemas']} | | | | | | | |")
            continue
        lines.append(
            f"| {res['backend']} | {res['compiled']}/{res['schemas']} | {c['median']:.2f} "
            f"| {c['p90']:.2f} | {c['p99']:.2f} | {c['max']:.2f} | {f['median']:.2f} "
            f"| {f['p99']:.2f} | {k['median']:.3f} |"
        )
    lines.append("")
    for res in results:
        slow = ", ".join(f"{n} {ms:.1f} ms" for n, ms in res["slowest"])
        lines.append(f"- {res['backend']}: slowest (compile + first mask): {slow}")
        for fail in res["failed"]:
            lines.append(f"- {res['backend']}: cannot compile {fail['name']}: {fail['error']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["both", "throughput", "compile"], default="both")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="alternated rounds")
    parser.add_argument("--max-tokens", type=int, default=256, help="guided max_tokens")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0, help="request i gets seed + i")
    parser.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time mask apply, grammar accept and the front end by wrapping them",
    )
    parser.add_argument("--schemas", default=DEFAULT_SCHEMAS, help="compile-mode corpus")
    parser.add_argument(
        "--compile-repeats", type=int, default=1, help="per schema, median of N fresh compiles"
    )
    parser.add_argument("--limit-schemas", type=int, default=None, help="first N schemas only")
    parser.add_argument("--out", default=None, help="write every figure here (JSON)")
    args = parser.parse_args()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            parser.error(f"unknown backend {b!r}")

    command = " ".join([".venv/bin/python", os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    result: dict[str, Any] = {
        "command": command,
        "start": now_str(),
        "commit": _git_commit(),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": _versions(),
        "loadavg_start": os.getloadavg(),
    }
    log(f"[{result['start']}] {command}")
    sections = []
    if args.mode in ("both", "throughput"):
        tp = []
        for backend in backends:
            tp.append(throughput_backend(backend, args))
            gc.collect()
        result["throughput"] = tp
        sections.append(
            f"### Guided vs unconstrained, {NUM_PROMPTS} concurrent requests ({args.dtype})\n\n"
            + throughput_tables(tp)
        )
    if args.mode in ("both", "compile"):
        schemas, source = load_schemas(args.schemas)
        if args.limit_schemas:
            schemas = schemas[: args.limit_schemas]
        result["schema_source"] = source
        cp = [compile_backend(b, schemas, args) for b in backends]
        result["compile"] = cp
        sections.append(
            f"### JSON schema compile time ({len(schemas)} schemas from {source}, fresh backend "
            "per schema)\n\n" + compile_tables(cp)
        )
    result["end"] = now_str()
    result["loadavg_end"] = os.getloadavg()
    print(
        f"Command: `{command}` ({result['start']} - {result['end']}, commit {result['commit']}; "
        f"1-min load average {result['loadavg_start'][0]:.2f} at the start, "
        f"{result['loadavg_end'][0]:.2f} at the end)"
    )
    print()
    print("\n\n".join(sections))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)
        log(f"wrote {args.out}")


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("xgrammar", "llguidance", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "missing"
    return out


if __name__ == "__main__":
    main()
