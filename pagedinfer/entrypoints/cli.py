"""The `pagedinfer` command line: `generate` (one-shot) and `chat` (interactive, streaming).

Also `serve` (the OpenAI-compatible server), `disagg-proxy`, `trace`, `bench` and
`train-draft`.

Engine flags come from `engine/arg_utils.py`, which generates them from the config
dataclasses (every field becomes `--field-name`, with its docstring as help), so the CLI,
the `LLM(...)` keyword options and the docs never drift apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from pagedinfer.engine.arg_utils import add_engine_args, engine_kwargs
from pagedinfer.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["main", "build_parser"]


_ENGINE_DEATH_GRACE_S = 2.0
"""`serve`: how long the server answers 503s after the engine core died, before it exits."""


def _add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="Tokens to generate.")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default).")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="Per-request sampling seed (same output whatever the batch).",
    )
    group.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")


def _sampling_params(ns: argparse.Namespace, **extra: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
        stop=ns.stop,
        **extra,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedinfer", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Generate completions for prompts and print them.")
    _add_model_arg(gen)
    gen.add_argument("--prompt", action="append", default=None, help="Prompt text (repeatable).")
    gen.add_argument("--prompts-file", default=None, help="A file with one prompt per line.")
    gen.add_argument(
        "--chat-template",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Wrap each prompt as a user message in the model's chat template.",
    )
    _add_sampling_args(gen, max_tokens=64)
    add_engine_args(gen)

    chat = sub.add_parser("chat", help="Interactive chat; streams the reply token by token.")
    _add_model_arg(chat)
    chat.add_argument("--system", default=None, help="System prompt.")
    _add_sampling_args(chat, max_tokens=256)
    add_engine_args(chat)

    _add_serving_parsers(sub)

    trace = sub.add_parser(
        "trace", help="Render an engine trace (LLM(trace_path=...)) as an HTML timeline."
    )
    trace.add_argument("trace_file", help="The JSON-lines trace the engine wrote.")
    trace.add_argument("-o", "--output", default="trace.html", help="HTML file to write.")
    trace.add_argument("--title", default=None, help="Page title (default: the file name).")
    from pagedinfer.bench import add_bench_parser

    add_bench_parser(sub)
    _add_train_draft_parser(sub)
    return parser


def _add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="GGUF file or HF directory (default: SmolLM2-135M-Instruct).",
    )


def _add_serving_parsers(sub: Any) -> None:
    """`serve` and `disagg-proxy`."""
    serve = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (engine core in its own process)."
    )
    _add_model_arg(serve)
    serve.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    serve.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="Require 'Authorization: Bearer KEY' on /v1 routes; repeat the flag for several "
        "keys (one per tenant), accepted alike.",
    )
    serve.add_argument(
        "--isolate-tenants",
        default=None,
        metavar="api-key|header:NAME",
        help="Salt every request's prefix-cache blocks with its tenant: the API key it "
        "presented, or the value of header NAME (then required). Tenants share no cached "
        "blocks, so `cached_tokens` and timing tell one nothing of another's prompts "
        "(docs/serving.md).",
    )
    serve.add_argument(
        "--chat-template",
        default=None,
        help="A jinja chat template, or a file holding one, used instead of the model's own "
        "(needed for chat requests to a model without one, such as a base model).",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="Model name in the API (default: the file's)."
    )
    from pagedinfer.entrypoints.openai.reasoning import REASONING_PARSERS
    from pagedinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS

    serve.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="How the model writes tool calls (docs/tools.md): what reads them out of its "
        'answers when a request\'s tool_choice is "auto".',
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Serve tool_choice "auto" (the default with tools); needs --tool-call-parser.',
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="How the model marks its reasoning (docs/reasoning.md): chat answers then carry "
        "it in `reasoning` / `reasoning_content`, and guided decoding and tool parsing start "
        "after it.",
    )
    serve.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Answer GET /tokenizer_info (special tokens and the chat template), which "
        "clients such as lm-evaluation-harness use to tokenize through the server.",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 << 20,
        help="The largest request body taken (a 413 beyond; default 8 MiB).",
    )
    serve.add_argument(
        "--client-timeout-s",
        type=float,
        default=30.0,
        help="Time a client has to send a request's head, and then its body (default 30): "
        "the connection is closed (head) or answered 408 (body) after it.",
    )
    serve.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="Prompts (or embedding inputs) times n in one request (a 400 beyond; default "
        "256): one request cannot fill the engine alone.",
    )
    serve.add_argument(
        "--content-special-tokens-as-text",
        action="store_true",
        help="Encode special-token strings a chat message's content contains (a user "
        "writing '<|im_start|>') as the plain text they are, not as control tokens; off by "
        "default, as in vLLM.",
    )
    serve.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="Keep serving (503s, /health 503) after the engine core dies, instead of "
        f"exiting with status 1 after {_ENGINE_DEATH_GRACE_S:g} s.",
    )
    serve.add_argument(
        "--trust-kv-transfer-params",
        action="store_true",
        help="Take clients' kv_transfer_params without a transfer secret: only for an "
        "instance that nobody but its disaggregation proxy can reach (docs/disaggregation.md).",
    )
    add_engine_args(serve)
    # A server shares its cores with its API process and its clients: measured with aiperf
    # (40 requests, concurrency 4) on the same 2 cores, mean ITL 327 ms with 2 fixed threads
    # and 14.2-14.4 ms with the governor, against 11.2-12.3 ms under guidellm's light client
    # (docs/benchmarks.md, "Two load generators"). Offline runs own their machine: off there.
    serve.set_defaults(adapt_threads=True)
    # A server's streams must not stall while a long prompt is prefilled (issue 24): steps
    # with decodes get the prompt tokens that keep them near 250 ms (core/step_budget.py).
    # Offline runs want throughput: off there.
    serve.set_defaults(step_latency_target_ms=250.0)

    proxy = sub.add_parser(
        "disagg-proxy",
        help="Disaggregated prefill/decode proxy in front of `pagedinfer serve` instances.",
    )
    proxy.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="Base URLs of the prefill instances (e.g. http://127.0.0.1:8100).",
    )
    proxy.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="Base URLs of the decode instances (e.g. http://127.0.0.1:8200).",
    )
    proxy.add_argument("--host", default="127.0.0.1", help="Address to listen on.")
    proxy.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    proxy.add_argument(
        "--policy",
        choices=["round_robin", "least_loaded"],
        default="round_robin",
        help="How an instance is picked in each pool: rotation, or fewest requests in flight "
        "from this proxy (default: round_robin).",
    )
    proxy.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="Bound on each upstream call; for a streamed decode, on the wait for its headers "
        "and each gap between chunks (default: 600).",
    )
    proxy.add_argument(
        "--connect-timeout-s",
        type=float,
        default=5.0,
        help="Bound on connecting to an upstream (and on each /health probe) (default: 5).",
    )


def _add_train_draft_parser(sub: Any) -> None:
    p = sub.add_parser(
        "train-draft",
        help="Train EAGLE or Medusa draft heads by self-distillation on ShareGPT prompts.",
    )
    p.add_argument("--method", choices=["eagle", "medusa"], required=True)
    p.add_argument("--out", required=True, help="The .safetensors file to write.")
    p.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)."
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32")
    p.add_argument(
        "--num-prompts", type=int, default=800, help="Training prompts: ShareGPT rows [0, N)."
    )
    p.add_argument(
        "--dataset-path",
        default=None,
        help="The ShareGPT JSON to train on (default, where it exists: sharegpt_v3_sample.json "
        "in $PAGEDINFER_DATA_DIR, else in shared/data next to the repository).",
    )
    p.add_argument("--max-tokens", type=int, default=192, help="Greedy tokens per prompt.")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--num-medusa-heads", type=int, default=5)
    p.add_argument("--epochs", type=int, default=None, help="Default: the method's.")
    p.add_argument(
        "--lr", type=float, default=None, help="Peak learning rate (default: the method's)."
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--train-dtype",
        choices=["float32", "bfloat16", "auto"],
        default="auto",
        help="bfloat16: the heads' matmuls autocast to bf16 (AMX: ~2x faster); auto: where "
        "the CPU has native bf16.",
    )
    p.add_argument(
        "--all-turns",
        action="store_true",
        help="Every user turn of the training rows is a prompt (default: turn 0 only).",
    )
    p.add_argument(
        "--aux-layers",
        default=None,
        help="EAGLE: comma-separated target layers (0-based) whose residual streams join h_t "
        "as the first draft step's input (fused features, as EAGLE-3, e.g. 2,15); default: "
        "h_t alone.",
    )
    p.add_argument(
        "--data-cache",
        default=None,
        help="File for the generated sequences and features: written once, reused by later "
        "runs with the same model, dtype, prompts and --max-tokens (e.g. the other method).",
    )


def _cmd_train_draft(ns: argparse.Namespace) -> int:
    from pagedinfer.bench.datasets import resolve_dataset_path
    from pagedinfer.training.draft_heads import train_draft

    try:
        dataset_path = resolve_dataset_path(ns.dataset_path, "--dataset-path")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    train_draft(
        ns.method,
        out=ns.out,
        dataset_path=dataset_path,
        model=ns.model,
        dtype=ns.dtype,
        num_prompts=ns.num_prompts,
        max_tokens=ns.max_tokens,
        draft_vocab_size=ns.draft_vocab_size,
        num_medusa_heads=ns.num_medusa_heads,
        epochs=ns.epochs,
        lr=ns.lr,
        seed=ns.seed,
        data_cache=ns.data_cache,
        all_turns=ns.all_turns,
        train_dtype=ns.train_dtype,
        aux_layers=_parse_layers(ns.aux_layers),
    )
    return 0


def _parse_layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    if text.strip().lower() == "none":
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"--aux-layers: expected comma-separated integers or 'none', got {text!r}"
        ) from None


def _cmd_trace(ns: argparse.Namespace) -> int:
    from pagedinfer.core.trace import load_trace, render_html

    try:
        header, steps = load_trace(ns.trace_file)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(ns.output, "w", encoding="utf-8") as f:
        f.write(render_html(header, steps, title=ns.title or os.path.basename(ns.trace_file)))
    print(f"{len(steps)} steps -> {ns.output}", file=sys.stderr)
    return 0


def _cmd_generate(ns: argparse.Namespace) -> int:
    from pagedinfer.entrypoints.llm import LLM

    prompts: list[str] = list(ns.prompt or [])
    if ns.prompts_file:
        with open(ns.prompts_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    if not prompts:
        prompts = ["Write a haiku about paged attention."]
        ns.chat_template = True
    llm = LLM(**engine_kwargs(ns))
    params = _sampling_params(ns)
    if ns.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        print(f"\n=== Prompt: {prompt!r}")
        print(completion.text)
        print(f"--- [{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]")
    stats = llm.get_stats()
    print(
        f"\nThroughput: {stats['generation_throughput']:.1f} output tok/s, "
        f"{stats['prompt_throughput']:.1f} prompt tok/s"
    )
    return 0


def _cmd_chat(ns: argparse.Namespace) -> int:
    from pagedinfer.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(ns))
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    messages: list[dict[str, str]] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("Chat with the model; an empty line or Ctrl-D quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            user = input("\n> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        params = _sampling_params(ns, output_kind=RequestOutputKind.DELTA)
        request_id = f"chat-{turn}"
        turn += 1
        engine.add_request(request_id, {"prompt_token_ids": ids}, params)
        reply: list[str] = []
        start, num_tokens = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].text
                num_tokens += len(out.outputs[0].token_ids)
                reply.append(delta)
                print(delta, end="", flush=True)
        elapsed = time.perf_counter() - start
        print(f"\n[{num_tokens} tokens, {num_tokens / elapsed:.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _cmd_serve(ns: argparse.Namespace) -> int:
    import asyncio

    from pagedinfer.extras import require_extra

    require_extra("serve", "fastapi", "uvicorn", "prometheus_client", feature="pagedinfer serve")
    import uvicorn

    from pagedinfer.distributed.kv_transfer.trust import accepts_client_params
    from pagedinfer.engine.async_llm import AsyncLLM
    from pagedinfer.entrypoints.openai.api_server import (
        DEFAULT_MODEL_NAME,
        build_app,
        check_tenant_source,
    )
    from pagedinfer.entrypoints.openai.http_limits import protocol_with_head_timeout
    from pagedinfer.tokenizer import read_chat_template

    try:
        chat_template = None if ns.chat_template is None else read_chat_template(ns.chat_template)
        check_tenant_source(ns.isolate_tenants, bool(ns.api_key))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        print("error: --enable-auto-tool-choice needs --tool-call-parser", file=sys.stderr)
        return 2
    engine = AsyncLLM.from_options(**engine_kwargs(ns))
    name = ns.served_model_name or (
        os.path.splitext(os.path.basename(ns.model.rstrip("/")))[0]
        if ns.model
        else DEFAULT_MODEL_NAME
    )
    app = build_app(
        engine,
        name,
        ns.api_key,
        shutdown_engine=True,
        chat_template=chat_template,
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        reasoning_parser=ns.reasoning_parser,
        enable_tokenizer_info=ns.enable_tokenizer_info_endpoint,
        accept_kv_transfer_params=accepts_client_params(
            engine.config.kv_transfer_config, ns.trust_kv_transfer_params
        ),
        isolate_tenants=ns.isolate_tenants,
        max_sequences_per_request=ns.max_sequences_per_request,
        max_request_bytes=ns.max_request_bytes,
        client_timeout_s=ns.client_timeout_s,
        content_special_tokens_as_text=ns.content_special_tokens_as_text,
    )
    curl = (
        f"  curl http://{ns.host}:{ns.port}/v1/chat/completions -H 'Content-Type: application/json'"
        + (f" -H 'Authorization: Bearer {ns.api_key[0]}'" if ns.api_key else "")
        + f' -d \'{{"model": "{name}", "messages": [{{"role": "user", '
        f'"content": "Name three colours."}}], "max_tokens": 40}}\''
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=ns.host,
            port=ns.port,
            log_level="warning",
            http=protocol_with_head_timeout(ns.client_timeout_s),
        )
    )

    engine_died = False

    async def exit_when_the_engine_dies() -> None:
        # vLLM's API server exits too (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH keeps it): a server
        # answering 503 forever hides the failure from whatever restarts it.
        nonlocal engine_died
        while not engine.errored:
            await asyncio.sleep(0.5)
        engine_died = True
        message = (
            f"error: the engine core died; the server exits in {_ENGINE_DEATH_GRACE_S:g} s "
            "(--keep-alive-on-engine-death keeps it up)"
        )
        print(message, file=sys.stderr, flush=True)
        await asyncio.sleep(_ENGINE_DEATH_GRACE_S)  # in-flight requests get their 503s
        server.should_exit = True

    async def run() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:  # listening: now the line works
            print(f"Serving {name} on http://{ns.host}:{ns.port} (Ctrl-C stops). Try:\n{curl}",
                  flush=True)  # fmt: skip
        watcher = None
        if not ns.keep_alive_on_engine_death:
            watcher = asyncio.ensure_future(exit_when_the_engine_dies())
        await task
        if watcher is not None:
            watcher.cancel()

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    return 0 if server.started and not engine_died else 1


def _cmd_disagg_proxy(ns: argparse.Namespace) -> int:
    from pagedinfer.extras import require_extra

    require_extra("serve", "fastapi", "uvicorn", "aiohttp", feature="pagedinfer disagg-proxy")
    from pagedinfer.entrypoints.disagg_proxy import run_proxy

    return run_proxy(
        ns.prefill,
        ns.decode,
        host=ns.host,
        port=ns.port,
        policy=ns.policy,
        request_timeout_s=ns.request_timeout_s,
        connect_timeout_s=ns.connect_timeout_s,
    )


def main(argv: list[str] | None = None) -> int:
    from pagedinfer.extras import MissingExtraError

    ns = build_parser().parse_args(argv)
    try:
        return _dispatch(ns)
    except MissingExtraError as exc:  # one line naming the extra, not a traceback
        print(f"pagedinfer: {exc}", file=sys.stderr)
        return 1


def _dispatch(ns: argparse.Namespace) -> int:
    if ns.command == "generate":
        return _cmd_generate(ns)
    if ns.command == "serve":
        return _cmd_serve(ns)
    if ns.command == "disagg-proxy":
        return _cmd_disagg_proxy(ns)
    if ns.command == "trace":
        return _cmd_trace(ns)
    if ns.command == "train-draft":
        return _cmd_train_draft(ns)
    if ns.command == "bench":
        from pagedinfer.bench import run_bench

        return run_bench(ns)
    return _cmd_chat(ns)


if __name__ == "__main__":
    raise SystemExit(main())
