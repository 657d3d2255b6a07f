"""Benchmark workloads shared by `bench serve` and `bench throughput`.

Every sampler is deterministic for a given seed and returns `SampleRequest`s:

- `sharegpt`: real conversations (vLLM's convention: turn 0 is the prompt, the token count of
  turn 1 the output length; rows too short or too long are dropped; see `is_valid_pair`).
- `random`: prompts of random token ids (never a special token), lengths drawn uniformly around
  `--random-input-len` / `--random-output-len`, optionally after a shared random prefix.
- `prefix-repetition`: a few random prefixes, each request one of them plus its own random
  suffix: a prefix-caching workload.

Random prompts stay token ids (the server's /v1/completions accepts a list of ints); text
prompts stay text.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
from typing import Any, Protocol

import numpy as np

from pagedinfer import envs

__all__ = [
    "DATASET_NAMES",
    "MAX_PROMPT_LEN",
    "MAX_TOTAL_LEN",
    "MIN_SEQ_LEN",
    "SHAREGPT_FILE",
    "SampleRequest",
    "add_dataset_args",
    "allowed_token_ids",
    "dataset_config",
    "default_data_dir",
    "default_sharegpt_path",
    "is_valid_pair",
    "load_tokenizer",
    "resolve_dataset_path",
    "sample_from_args",
    "sample_prefix_repetition",
    "sample_random",
    "sample_sharegpt",
]

DATASET_NAMES = ("sharegpt", "random", "prefix-repetition")
MIN_SEQ_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
SHAREGPT_FILE = "sharegpt_v3_sample.json"
"""The default dataset's name in `default_data_dir()`."""


class TokenizerLike(Protocol):
    """What the samplers need of `pagedinfer.tokenizer.Tokenizer`."""

    all_special_ids: set[int]

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclasses.dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int
    expected_output_len: int


def default_data_dir() -> str:
    """$PAGEDINFER_DATA_DIR, else `shared/data` next to the repository."""
    env = envs.data_dir()
    if env:
        return env
    import pagedinfer

    here = os.path.dirname(pagedinfer.__file__)
    return os.path.normpath(os.path.join(here, "..", "..", "shared", "data"))


def default_sharegpt_path() -> str:
    """Where the convenience default ShareGPT file is looked for (it may not exist)."""
    return os.path.join(default_data_dir(), SHAREGPT_FILE)


def resolve_dataset_path(path: str | None, option: str) -> str:
    """`path`, else the default ShareGPT file when it exists; else a ValueError naming
    `option` (the caller's parameter or flag), as nothing else says which file to read."""
    if path:
        return path
    default = default_sharegpt_path()
    if os.path.isfile(default):
        return default
    raise ValueError(
        f"no dataset given: pass {option} (a ShareGPT JSON file); the default, {default}, "
        "does not exist"
    )


def load_tokenizer(model: str | None = None):
    """The engine's tokenizer for `model` (a .gguf or HF directory; None: the default model)."""
    from pagedinfer.tokenizer import Tokenizer

    if model is None:
        from pagedinfer.gguf_metadata import find_default_model

        model = find_default_model()
    return Tokenizer.from_model_path(model)


def is_valid_pair(prompt_len: int, output_len: int, fixed_output_len: bool = False) -> bool:
    """vLLM's ShareGPT filter: prompt and output at least 4 tokens, prompt at most 1,024, both
    together at most 2,048. A fixed (user-given) output length skips the minimum-output check."""
    if prompt_len < MIN_SEQ_LEN:
        return False
    if not fixed_output_len and output_len < MIN_SEQ_LEN:
        return False
    return prompt_len <= MAX_PROMPT_LEN and prompt_len + output_len <= MAX_TOTAL_LEN


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def sample_sharegpt(
    tokenizer: TokenizerLike,
    num_requests: int,
    path: str | None = None,
    seed: int = 0,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """`num_requests` ShareGPT rows: rows with >= 2 turns, shuffled with random.Random(seed),
    filtered by `is_valid_pair`, the first ones kept. `output_len` overrides turn 1's length.
    With fewer valid rows than asked, valid rows are repeated (drawn with the same seed).
    `path`: the ShareGPT JSON (default: `default_sharegpt_path()` if it exists)."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be > 0, got {num_requests}")
    if output_len is not None and output_len <= 0:
        raise ValueError(f"--sharegpt-output-len must be > 0, got {output_len}")
    path = resolve_dataset_path(path, "`path`")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rows = [
        row
        for row in data
        if isinstance(row, dict)
        and isinstance(row.get("conversations"), list)
        and len(row["conversations"]) >= 2
    ]
    rng = random.Random(seed)
    rng.shuffle(rows)
    out: list[SampleRequest] = []
    for row in rows:
        turns = row["conversations"]
        prompt = turns[0].get("value") if isinstance(turns[0], dict) else None
        reply = turns[1].get("value") if isinstance(turns[1], dict) else None
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        prompt_len = len(tokenizer.encode(prompt))
        out_len = output_len if output_len is not None else len(tokenizer.encode(reply))
        if not is_valid_pair(prompt_len, out_len, fixed_output_len=output_len is not None):
            continue
        out.append(SampleRequest(prompt, prompt_len, out_len))
        if len(out) == num_requests:
            return out
    if not out:
        raise ValueError(f"{path}: no conversation passes the length filter")
    _warn(
        f"{path} has only {len(out)} usable conversations for {num_requests} requests; "
        "repeating some (prefix caching will see the repeats)"
    )
    extra = [dataclasses.replace(rng.choice(out)) for _ in range(num_requests - len(out))]
    return out + extra


def allowed_token_ids(tokenizer: TokenizerLike, vocab_size: int | None = None) -> np.ndarray:
    """Every id below the vocabulary size (the model's, if given and smaller) but the
    tokenizer's special ids."""
    size = tokenizer.vocab_size if vocab_size is None else min(vocab_size, tokenizer.vocab_size)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(size) if i not in special], np.int64)
    if allowed.size == 0:
        raise ValueError("the tokenizer has no non-special tokens")
    return allowed


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    return math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))


def sample_random(
    tokenizer: TokenizerLike,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[SampleRequest]:
    """Random token-id prompts: a random prefix of `prefix_len` tokens shared by every request,
    then each request's own random tokens, their count uniform in
    [input_len * (1 - r), input_len * (1 + r)]; output lengths likewise around `output_len`."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be > 0, got {num_requests}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 0 or prefix_len < 0 or output_len < 1:
        raise ValueError("random lengths: input and prefix must be >= 0, output >= 1")
    if input_len + prefix_len < 1:
        raise ValueError("random prompts need --random-input-len + --random-prefix-len >= 1")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer, vocab_size)
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    lo, hi = _length_range(input_len, range_ratio)
    in_lens = rng.integers(lo, hi + 1, size=num_requests)
    lo, hi = _length_range(output_len, range_ratio)
    out_lens = rng.integers(max(lo, 1), max(hi, 1) + 1, size=num_requests)
    out: list[SampleRequest] = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        n_in = max(n_in, 1 - prefix_len)  # never an empty prompt
        ids = prefix + rng.choice(allowed, size=n_in).tolist()
        out.append(SampleRequest(ids, len(ids), int(n_out)))
    return out


def sample_prefix_repetition(
    tokenizer: TokenizerLike,
    num_requests: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[SampleRequest]:
    """`num_prefixes` random prefixes; request i is prefix i % num_prefixes followed by its own
    random suffix; the requests are then shuffled."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be > 0, got {num_requests}")
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or output_len < 1:
        raise ValueError(
            "prefix-repetition: need num_prefixes >= 1, lengths >= 0 and output_len >= 1"
        )
    if prefix_len + suffix_len < 1:
        raise ValueError("prefix-repetition prompts need prefix_len + suffix_len >= 1")
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tokenizer, vocab_size)
    prefixes = [rng.choice(allowed, size=prefix_len).tolist() for _ in range(num_prefixes)]
    out: list[SampleRequest] = []
    for i in range(num_requests):
        ids = prefixes[i % num_prefixes] + rng.choice(allowed, size=suffix_len).tolist()
        out.append(SampleRequest(ids, len(ids), output_len))
    order = rng.permutation(num_requests).tolist()
    return [out[i] for i in order]


def add_dataset_args(parser: argparse.ArgumentParser, *, with_seed: bool = True) -> None:
    """The dataset options; `with_seed=False` where the engine options already define --seed."""
    group = parser.add_argument_group("dataset options")
    group.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default="sharegpt",
        help="Workload kind (default: sharegpt).",
    )
    group.add_argument(
        "--num-prompts", type=int, default=1000, help="Number of requests (default: 1000)."
    )
    if with_seed:
        group.add_argument(
            "--seed",
            type=int,
            default=0,
            help="Seed of the dataset sampling and arrival times (default: 0).",
        )
    group.add_argument(
        "--dataset-path",
        default=None,
        help="sharegpt: the JSON file (default, where it exists: sharegpt_v3_sample.json in "
        "$PAGEDINFER_DATA_DIR, else in shared/data next to the repository).",
    )
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: output length of every request (default: the token count of turn 1).",
    )
    group.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="random: prompt tokens after the prefix (default: 1024).",
    )
    group.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="random: tokens to generate (default: 128).",
    )
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [len*(1-r), len*(1+r)], 0 <= r < 1 (default: 0).",
    )
    group.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="random: random tokens shared by every request, before its own (default: 0).",
    )
    group.add_argument(
        "--prefix-repetition-prefix-len",
        type=int,
        default=256,
        help="prefix-repetition: tokens of each shared prefix (default: 256).",
    )
    group.add_argument(
        "--prefix-repetition-suffix-len",
        type=int,
        default=256,
        help="prefix-repetition: each request's own random tokens (default: 256).",
    )
    group.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int,
        default=10,
        help="prefix-repetition: distinct prefixes, used in turn (default: 10).",
    )
    group.add_argument(
        "--prefix-repetition-output-len",
        type=int,
        default=128,
        help="prefix-repetition: tokens to generate (default: 128).",
    )


def sample_from_args(
    ns: argparse.Namespace, tokenizer: TokenizerLike, vocab_size: int | None = None
) -> list[SampleRequest]:
    """Sample the dataset the options name; `vocab_size` (the model's) bounds random ids."""
    seed = int(getattr(ns, "seed", 0) or 0)
    if ns.dataset_name == "sharegpt":
        path = resolve_dataset_path(ns.dataset_path, "--dataset-path")
        return sample_sharegpt(tokenizer, ns.num_prompts, path, seed, ns.sharegpt_output_len)
    if ns.dataset_name == "random":
        return sample_random(
            tokenizer,
            ns.num_prompts,
            input_len=ns.random_input_len,
            output_len=ns.random_output_len,
            range_ratio=ns.random_range_ratio,
            prefix_len=ns.random_prefix_len,
            seed=seed,
            vocab_size=vocab_size,
        )
    if ns.dataset_name == "prefix-repetition":
        return sample_prefix_repetition(
            tokenizer,
            ns.num_prompts,
            prefix_len=ns.prefix_repetition_prefix_len,
            suffix_len=ns.prefix_repetition_suffix_len,
            num_prefixes=ns.prefix_repetition_num_prefixes,
            output_len=ns.prefix_repetition_output_len,
            seed=seed,
            vocab_size=vocab_size,
        )
    raise ValueError(f"unknown dataset {ns.dataset_name!r}")


def dataset_config(ns: argparse.Namespace) -> dict[str, Any]:
    """The dataset options of a run, for result files."""
    keys = ["dataset_name", "num_prompts", "seed"]
    if ns.dataset_name == "sharegpt":
        keys += ["dataset_path", "sharegpt_output_len"]
    elif ns.dataset_name == "random":
        keys += ["random_input_len", "random_output_len", "random_range_ratio", "random_prefix_len"]
    else:
        keys += [
            "prefix_repetition_prefix_len",
            "prefix_repetition_suffix_len",
            "prefix_repetition_num_prefixes",
            "prefix_repetition_output_len",
        ]
    out = {k: getattr(ns, k, None) for k in keys}
    if ns.dataset_name == "sharegpt":
        out["dataset_path"] = resolve_dataset_path(out["dataset_path"], "--dataset-path")
    return out
