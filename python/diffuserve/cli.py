"""The `diffuserve` command: serve a model over HTTP, generate from the terminal, benchmark."""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import ssl
import sys
import threading
import time
from typing import Optional

from tqdm import tqdm

from . import __version__
from ._checks import INT32_MAX, check_encoded, check_unicode
from .llm import VLLM_ENGINE_ARGUMENTS

MAX_BENCH_REQUESTS = 65536  # a bench row's requests (its prompts are drawn at once)


def origins(text: str) -> list:
    """An argparse type: one origin, or vLLM's form of the option, a JSON list of them
    ('["https://app.example"]' had been taken as one origin of that name, matching none)."""
    if not text.lstrip().startswith("["):
        return [text]
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of origins: {e}") from None
    if not isinstance(value, list) or not all(isinstance(origin, str) for origin in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of origins (strings)")
    return value


def in_range(kind, lo, hi):
    """An argparse type: an int (kind int) or a finite number (kind float) in [lo, hi]; argparse
    turns its error into a usage error naming the option."""
    bound = (lambda x: f"{x:g}") if kind is float else str

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "a number" if kind is float else "an integer"
            raise argparse.ArgumentTypeError(f"{text!r} is not {expected}") from None
        if not lo <= value <= hi:  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text} is outside [{bound(lo)}, {bound(hi)}]")
        return value
    return parse


# An argparse type: a KV cache's size in GiB (the server's, bench's and the benchmarks').
KV_CACHE_GIB = in_range(float, 2**-30, 2**32)


def int_list(hi: int):
    """An argparse type: comma-separated integers in [1, hi]."""
    return lambda text: [in_range(int, 1, hi)(item) for item in text.split(",")]


def _safetensors_bytes(path: str) -> int:
    """The bytes of the checkpoint's safetensors files, for the loading line. A file that
    cannot be read (a link to nothing, as a half-cleaned Hugging Face cache leaves) counts
    nothing here: the loader says so if it needs the file."""
    size = 0
    for entry in os.scandir(path):
        if entry.name.endswith(".safetensors"):
            try:
                size += entry.stat().st_size
            except OSError:
                pass
    return size


def _load(path: Optional[str], args):
    """The LLM for checkpoint `path`, with a progress line while it loads. The runtime
    reports no finer progress than done/not done, so the line shows the time spent."""
    from . import default_model
    from .hub_cache import resolve_checkpoint
    from .llm import LLM

    try:
        path = default_model() if path is None else resolve_checkpoint(path)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    if not os.path.isdir(path):
        sys.exit(f"error: {path!r} is not a directory (a checkpoint is a directory: config.json, *.safetensors, "
                 "tokenizer.json)")
    size = _safetensors_bytes(path)
    kv_bytes = None if args.kv_cache_gib is None else int(args.kv_cache_gib * 2**30)
    loaded = threading.Event()
    with tqdm(desc=f"loading {path} ({size / 1e9:.2f} GB)", bar_format="{desc}: {elapsed}", file=sys.stderr) as bar:
        def tick():
            while not loaded.wait(0.2):
                bar.refresh()
        threading.Thread(target=tick, daemon=True).start()
        try:
            return LLM(path, device=args.device, dtype=args.dtype, num_threads=args.threads,
                       kv_cache_memory_bytes=kv_bytes, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, load_format=args.load_format,
                       slice_steps=getattr(args, "slice_steps", 8), activations=args.activations,
                       kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len)
        except (ValueError, MemoryError) as e:
            sys.exit(f"error: {e}")
        finally:
            loaded.set()


def _check_utf8_argument(name: str, text: str) -> None:
    """A command-line argument's bytes that are not UTF-8 reach Python as the surrogates
    U+DC80..U+DCFF (surrogateescape): say so, naming the first byte, not "surrogates"."""
    at = next((i for i, c in enumerate(text) if "\udc80" <= c <= "\udcff"), None)
    if at is not None:
        raise ValueError(f"{name} is not valid UTF-8: byte 0x{ord(text[at]) - 0xDC00:02x} at character {at}")


def _utf8_lines(f, path: str):
    """The lines of a text file opened as UTF-8; bytes that are not UTF-8 are an error naming the file."""
    try:
        yield from f
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e.reason} (byte 0x{e.object[e.start]:02x})") from None


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: an address it cannot listen on (a
    port in use, a host that is no address of this machine) is refused at once (uvicorn's own
    refusal comes among its log lines), nothing can take the port while the model loads, and
    port 0 has its free port chosen here, to be printed. Bound as uvicorn binds (IPv6 where the
    host has a colon, so "::" takes IPv4 clients too; else IPv4: "localhost" is 127.0.0.1),
    and not yet listening: until the server is up, connections are refused rather than left
    waiting (a readiness probe that connects would pass too early)."""
    if not host.strip():  # (the socket takes "" as every interface: a setting left empty)
        sys.exit("error: --host is empty; give an address (0.0.0.0: every interface)")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, TypeError, UnicodeError) as e:  # (a name IDNA cannot encode is a TypeError)
        sock.close()
        sys.exit(f"error: cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}")
    return sock


def _chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template as vLLM takes it: a file's path, or the template itself (text with a
    brace or a line break, which no path given on a command line has); compiled here, so that
    a broken one stops serve before the model loads."""
    from .chat_template import ChatTemplate, ChatTemplateError

    if value is None:
        return None
    source = value
    if os.path.isfile(value) or not any(c in value for c in "{}\n"):
        try:
            with open(value, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            sys.exit(f"error: --chat-template {value!r}: {getattr(e, 'strerror', None) or e} (give a template's "
                     "file, or the template itself)")
    try:
        ChatTemplate(source, {})
    except ChatTemplateError as e:
        sys.exit(f"error: --chat-template: {e}")
    return source


def _check_tls(certfile: Optional[str], keyfile: Optional[str]) -> None:
    """Loads the certificate and key as uvicorn will, so that a wrong file stops serve before
    the model loads, with what is wrong (uvicorn's refusal comes as a traceback after it)."""
    if keyfile is not None and certfile is None:
        sys.exit("error: --ssl-keyfile needs --ssl-certfile (the certificate it is the key of)")
    if certfile is not None:
        try:
            # (An encrypted key is refused here rather than asking for its passphrase on the terminal.)
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=b"")
        except (OSError, ssl.SSLError) as e:
            sys.exit(f"error: --ssl-certfile {certfile!r}" + (f" / --ssl-keyfile {keyfile!r}" if keyfile else "")
                     + f": {getattr(e, 'strerror', None) or e} (a key must be PEM, and not encrypted)")


def serve(args) -> Optional[str]:
    from . import server
    from .async_llm import AsyncLLM

    try:
        server.check_api_key(args.api_key)
    except ValueError as e:
        sys.exit(f"error: --api-key (or DIFFUSERVE_API_KEY, VLLM_API_KEY): {e}")
    chat_template = _chat_template(args.chat_template)
    _check_tls(args.ssl_certfile, args.ssl_keyfile)
    sock = _bind(args.host, args.port)
    llm = _load(args.model, args)
    name = args.served_model_name or args.model or "diffuserve-sudoku"  # no model: the bundled one
    engine = AsyncLLM(llm)
    try:
        app = server.build_app(engine, name, api_key=args.api_key,
                               max_denoising_steps_limit=args.max_denoising_steps_limit,
                               allowed_origins=[o for group in args.allowed_origins or [["*"]] for o in group],
                               max_prompt_chars=args.max_prompt_chars,
                               max_request_bytes=args.max_request_bytes, chat_template=chat_template)
    except ValueError as e:  # (the checkpoint's defaults against the server's limits; the chat template)
        engine.shutdown()
        sys.exit(f"error: {e}")
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address, as URLs write it
    port = sock.getsockname()[1]
    scheme = "https" if args.ssl_certfile else "http"
    print(f"serving {name} at {scheme}://{host}:{port}/v1"
          + (" (API key required)" if args.api_key else "")
          + ("" if llm.tokenizer else " (no tokenizer.json: token ids in and out)"), file=sys.stderr)
    error = server.serve(app, engine, sock, args.log_level, args.shutdown_timeout,
                         access_log=not args.disable_uvicorn_access_log, ssl_certfile=args.ssl_certfile,
                         ssl_keyfile=args.ssl_keyfile)
    if error is not None:
        return f"error: the engine failed ({error!r}); the server has stopped"


def generate(args) -> None:
    from .chat_template import EMPTY_CHAT_PROMPT
    from .detokenizer import IncrementalDetokenizer, until_eos
    from .sampling import SamplingParams, length_untold

    llm = _load(args.model, args)
    tokenizer = llm.tokenizer
    if tokenizer is None:
        sys.exit(f"error: {args.model} has no tokenizer.json, so it cannot read text")
    try:  # the prompt's text (not valid Unicode: an error naming its own character) and the parameters
        _check_utf8_argument("the prompt", args.prompt)
        check_unicode("the prompt", args.prompt)
        if tokenizer.chat_template is not None and not args.raw:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                                 add_generation_prompt=True)
            if not text:
                raise ValueError(f"{EMPTY_CHAT_PROMPT} (--raw sends the prompt as it is)")
            prompt = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt = tokenizer.encode(args.prompt)
        check_encoded(prompt, "the prompt", llm.model.vocab_size)
        # Without --max-tokens, as the server without max_tokens.
        max_tokens = length_untold(args.max_tokens, llm.model.config["generation"]["length_given"],
                                   llm.model.config["max_model_len"])
        params = SamplingParams(max_new_tokens=max_tokens, seed=args.seed,
                                max_denoising_steps=args.max_denoising_steps,
                                eos_token_id=[] if args.ignore_eos else None, fit_to_context=args.max_tokens is None)
        request_id = llm.add_request(prompt, params)
    except ValueError as e:
        sys.exit(f"error: {e}")
    eos = [] if args.ignore_eos else llm.model.config["generation"]["eos_token_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    shown, start, output = 0, time.perf_counter(), None
    while output is None:  # print each block as it is committed
        finished = llm.step()
        output = finished[0] if finished else None
        tokens = until_eos(output.token_ids if output else llm.generated(request_id), eos)
        print(detokenizer.push(tokens[shown:]), end="", flush=True)
        shown = len(tokens)
    print(detokenizer.finish(), flush=True)
    seconds = time.perf_counter() - start
    print(f"[{len(output.token_ids)} tokens in {len(output.denoise_steps)} blocks, {sum(output.denoise_steps)} "
          f"denoise steps, {seconds:.2f} s, finish: {output.finish_reason}, seed {output.seed}]", file=sys.stderr)
    if output.finish_reason == "error":  # (it had exited 0, the reason unsaid)
        sys.exit(f"error: {output.error}")


def bench(args) -> None:
    from . import bench as benchmark

    try:
        benchmark.main(args.model, args.concurrency, args.prompt_tokens, args.max_tokens, args.steps,
                       load=lambda path: _load(path, args))
    except ValueError as e:  # a request the model cannot take (too long a prompt for its positions or cache)
        sys.exit(f"error: {e}")


def sudoku(args) -> None:
    from . import sudoku as sd

    # Options that the way of solving chosen would leave unused: a usage error, before the model loads.
    if args.eval is not None and args.puzzle is not None:
        args.parser.error("give PUZZLE or --eval FILE, not both")
    if args.output is not None and args.eval is None:
        args.parser.error("--output needs --eval (it writes the answers to the puzzles of --eval FILE)")
    if args.givens is not None and (args.eval is not None or args.puzzle is not None):
        args.parser.error("--givens is for a generated puzzle, not for PUZZLE or --eval FILE")
    if args.output is not None and os.path.realpath(args.output) == os.path.realpath(args.eval):
        args.parser.error("--output is the --eval file itself: its puzzles would be overwritten by the answers")
    if args.output is not None and (os.path.isdir(args.output) or
                                    not os.path.isdir(os.path.dirname(os.path.abspath(args.output)))):
        args.parser.error(f"--output {args.output}: not a file in an existing folder (checked before any solving)")
    args.slice_steps = 1  # the live view redraws after every denoise step
    llm = _load(args.model, args)
    try:
        digits = sd.digit_token_ids(llm.tokenizer)
        if args.eval is not None:
            puzzles, blank = [], []  # blank: each line's (a blank line is no puzzle)
            with open(args.eval, encoding="utf-8-sig") as f:  # (a byte-order mark is no cell)
                for number, line in enumerate(_utf8_lines(f, args.eval), 1):
                    blank.append(not line.strip())
                    try:
                        if not blank[-1]:
                            puzzles.append(sd.check_puzzle(sd.parse(line)))
                    except ValueError as e:
                        raise ValueError(f"{args.eval}, line {number}: {e}") from None
            grids, solved, steps = sd.solve_all(llm, puzzles, args.seed, max_denoising_steps=args.max_denoising_steps)
            if args.output is not None:  # an answer a puzzle's line, blank lines kept: line n answers line n
                answers = iter(grids)
                with open(args.output, "w") as f:
                    f.writelines("\n" if empty else sd.to_string(next(answers)) + "\n" for empty in blank)
            n = max(len(puzzles), 1)
            print(f"solved={sum(solved) / n:.4f} mean_steps={sum(steps) / n:.2f} n={len(puzzles)}")
            return
        if args.puzzle is not None:
            cells = sd.parse(args.puzzle)
        else:
            cells = sd.parse(sd.generate(30 if args.givens is None else args.givens, random.Random(args.seed))[0])
        prompt, params = sd.request(llm, cells, args.seed, max_denoising_steps=args.max_denoising_steps)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    live = sys.stdout.isatty()  # a terminal: redraw in place, givens in bold (main() saw to a stdout)
    givens = cells if live else None
    # (A generated puzzle keeps more givens than asked where fewer would not leave it one solution.)
    print(f"{sum(1 for v in cells if v)} givens:\n" + sd.format_grid(cells, givens) + "\n")
    request_id = llm.add_request(prompt, params)
    output, drawn = None, False
    while output is None:
        finished = llm.step()
        output = finished[0] if finished else None
        draft = llm.draft(request_id) if output is None else output.token_ids
        if live and draft:
            if drawn:
                print("\033[11F", end="")  # back to the top of the grid: redraw in place
            print(sd.format_grid(sd.grid_of(draft, digits), givens), flush=True)
            drawn = True
    if output.finish_reason == "error":  # no grid to show (it had failed drawing one)
        sys.exit(f"error: {output.error}")
    grid = sd.grid_of(output.token_ids, digits)
    if not live:
        print(sd.format_grid(grid))
    verdict = "valid and consistent with the givens" if sd.is_solution(grid, cells) else "NOT a valid solution"
    print(f"\n{sd.to_string(grid)}\n{verdict}; {sum(output.denoise_steps)} denoise steps")


def quantize(args) -> None:
    from .quantize import quantize as run

    try:
        run(args.src, args.dst, args.scheme)
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {args.scheme} checkpoint to {args.dst}", file=sys.stderr)


def _engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    group.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="cast the weights (default: config.json's dtype, as transformers; bfloat16 on a GPU)")
    group.add_argument("--activations", choices=["float32", "bfloat16"], default="float32",
                       help="the linears' inputs: float32 (fp32 products, the reference's numbers) or bfloat16 "
                            "(rounded to bf16 first, as transformers in bf16: about half the GPU's tensor-core "
                            "work) (default: float32)")
    group.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                       help="how the KV cache stores keys and values (default: auto, bf16 with bfloat16 "
                            "activations where the device's attention reads it: the same results in half the memory)")
    group.add_argument("--threads", type=in_range(int, 0, 1024), default=0,
                       help="CPU threads (default: one for each CPU the process may run on)")
    group.add_argument("--kv-cache-gib", type=KV_CACHE_GIB, default=None, metavar="GIB",
                       help="paged KV cache size (default: a quarter of RAM, at most 4 GiB; on a GPU 80%% "
                            "of the memory the weights leave)")
    group.add_argument("--max-num-seqs", type=in_range(int, 1, INT32_MAX), default=64, metavar="N",
                       help="requests computed at once (default: 64)")
    group.add_argument("--max-model-len", type=in_range(int, 1, 2**62), default=None, metavar="N",
                       help="the longest sequence (prompt and new tokens) a request may reach, at most the model's "
                            "max_position_embeddings (default: that)")
    group.add_argument("--max-num-batched-tokens", type=in_range(int, 1, 2**62), default=None, metavar="N",
                       help="rows per forward pass (default: max(4096, 4 canvases))")
    group.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                       help="dummy: random weights at config.json's shapes, for benchmarks (default: auto)")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="diffuserve", description="Inference engine for block-diffusion language models (DiffusionGemma).",
        epilog="Run `diffuserve COMMAND --help` for a command's options.")
    root.add_argument("--version", action="version", version=f"diffuserve {__version__}")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                            description="Serve MODEL over an OpenAI-compatible HTTP API: /v1/models, "
                                        "/v1/completions, /v1/chat/completions, /health, /metrics.")
    p.add_argument("model", nargs="?", metavar="MODEL", help="checkpoint directory, or a Hugging Face Hub id cached "
                   "locally (default: the bundled Sudoku model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=in_range(int, 0, 65535), default=8000, help="port (default: 8000)")
    # (vLLM's variable too: a deployment moved over keeps its key, where it had served openly.)
    p.add_argument("--api-key", default=os.environ.get("DIFFUSERVE_API_KEY", os.environ.get("VLLM_API_KEY")),
                   help="require `Authorization: Bearer KEY` on /v1, /tokenize and /detokenize (default: "
                        "$DIFFUSERVE_API_KEY, else vLLM's $VLLM_API_KEY, else none)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API (default: MODEL)")
    p.add_argument("--chat-template", metavar="TEMPLATE",
                   help="the Jinja chat template for chat requests: a file, or the template itself "
                        "(default: the checkpoint's)")
    p.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate (PEM; its key in it "
                   "or in --ssl-keyfile)")
    p.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM)")
    p.add_argument("--allowed-origins", action="append", type=origins, metavar="ORIGIN",
                   help="an origin whose browser pages may call the API (CORS), once per origin, or a JSON list "
                        "of them as vLLM takes (default: any, as vLLM)")
    p.add_argument("--max-denoising-steps-limit", type=in_range(int, 1, INT32_MAX), default=1024, metavar="N",
                   help="the most denoise steps a request may ask of each block (default: 1024)")
    p.add_argument("--max-prompt-chars", type=in_range(int, 0, 2**62), default=None, metavar="N",
                   help="the longest prompt text a request may send, refused before it is encoded (default: "
                        "max_model_len tokens of the vocabulary's longest entry; 0: no limit)")
    p.add_argument("--max-request-bytes", type=in_range(int, 0, 2**62), default=None, metavar="N",
                   help="the largest request body taken, a 413 past it (default: 64 MiB; 0: no limit)")
    p.add_argument("--shutdown-timeout", type=in_range(float, 0, 1e6), default=30, metavar="SECONDS",
                   help="on Ctrl-C / SIGTERM, how long running requests may finish before they are aborted "
                        "(default: 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the least severe log lines written (default: info)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no log line for each response (vLLM's name; errors and aborted requests are still logged)")
    _engine_options(p)
    p.set_defaults(run=serve)

    p = commands.add_parser("generate", help="generate from a prompt, printing the answer as it is made",
                            description="Generate an answer to PROMPT and print it block by block.")
    p.add_argument("prompt", metavar="PROMPT", help="the text (sent as a user message when the model has a chat "
                                                    "template)")
    p.add_argument("--model", "-m", help="checkpoint directory, or a Hugging Face Hub id cached locally (default: the "
                   "bundled Sudoku model)")
    p.add_argument("--max-tokens", type=in_range(int, 1, INT32_MAX), default=None,
                   help="output length cap (default: the checkpoint's, else the whole context, cut to the blocks "
                        "the context has room for)")
    p.add_argument("--max-denoising-steps", type=in_range(int, 1, INT32_MAX), default=None,
                   help="decoder passes per block at most")
    p.add_argument("--seed", type=in_range(int, 0, 2**64 - 1), default=None, help="seed for a reproducible answer")
    p.add_argument("--raw", action="store_true", help="send PROMPT as it is, without the chat template")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate on past the checkpoint's EOS tokens, to --max-tokens (an output of a fixed length)")
    _engine_options(p)
    p.set_defaults(run=generate)

    p = commands.add_parser("bench", help="measure generation throughput at several concurrencies",
                            description="Generation throughput of MODEL (default: a small random checkpoint) "
                                        "with 1, 4 and 16 concurrent requests, at a fixed number of denoise steps "
                                        "per block.")
    p.add_argument("model", nargs="?", metavar="MODEL", help="checkpoint directory (default: a small random one)")
    # (A row's prompts are drawn before it runs: two billion of them had run out of memory.)
    p.add_argument("--concurrency", type=int_list(MAX_BENCH_REQUESTS), default=[1, 4, 16],
                   help=f"comma-separated request counts, each at most {MAX_BENCH_REQUESTS} (default: 1,4,16)")
    p.add_argument("--prompt-tokens", type=in_range(int, 1, INT32_MAX), default=128,
                   help="prompt length (default: 128)")
    p.add_argument("--max-tokens", type=in_range(int, 1, INT32_MAX), default=256,
                   help="tokens generated per request (default: 256)")
    p.add_argument("--steps", type=in_range(int, 1, INT32_MAX), default=16,
                   help="denoise steps per block (default: 16)")
    _engine_options(p)
    p.set_defaults(run=bench)

    p = commands.add_parser("sudoku", help="solve a Sudoku, watching the canvas refine",
                            description="Solve PUZZLE (81 characters, '.' or '0' for blanks; default: a generated "
                                        "one) with a Sudoku model, redrawing the grid after every denoise step, "
                                        "then say whether it is valid. With --eval FILE, solve one puzzle per line "
                                        "and print solved=<fraction> mean_steps=<mean> n=<count>.")
    p.add_argument("puzzle", nargs="?", metavar="PUZZLE")
    p.add_argument("--model", "-m", help="a Sudoku checkpoint directory (default: the bundled one)")
    p.add_argument("--givens", type=in_range(int, 17, 81), default=None,
                   help="givens of a generated puzzle, at least (more where fewer leave it more than one "
                        "solution; default: 30)")
    p.add_argument("--seed", type=in_range(int, 0, 2**64 - 1), default=0,
                   help="seed of the puzzle and of the sampler (default: 0)")
    p.add_argument("--max-denoising-steps", type=in_range(int, 1, INT32_MAX), default=None,
                   help="default: the checkpoint's")
    p.add_argument("--eval", metavar="FILE", help="solve every puzzle in FILE, one per line")
    p.add_argument("--output", metavar="OUT", help="with --eval: write each answer grid to OUT, one per line")
    _engine_options(p)
    p.set_defaults(run=sudoku, parser=p)

    p = commands.add_parser("quantize", help="write an FP8 or NVFP4 copy of a checkpoint",
                            description="Quantize SRC's linear weights to DST in the compressed-tensors format "
                                        "LLM Compressor writes (fp8-dynamic: FP8_DYNAMIC; nvfp4: NVFP4A16).")
    p.add_argument("src", metavar="SRC", help="a bf16 or fp32 checkpoint directory, or a Hub id cached locally")
    p.add_argument("dst", metavar="DST", help="output directory")
    p.add_argument("--scheme", choices=["fp8-dynamic", "nvfp4"], default="fp8-dynamic",
                   help="fp8-dynamic (default) or nvfp4")
    p.set_defaults(run=quantize)
    return root


class _StatusStream:
    """sys.stderr for the commands' status lines (the loading line, progress, "wrote ..."): a
    stream that cannot take them (closed, where sys.stderr is None, or a full disk) drops
    them; the command goes on. (Under a supervisor with stderr closed, serve had died at its
    loading line, saying nothing.)"""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (AttributeError, OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (AttributeError, OSError, ValueError):
            pass

    def isatty(self) -> bool:
        try:
            return self._stream.isatty()
        except (AttributeError, OSError, ValueError):
            return False

    def __getattr__(self, name):  # encoding, fileno, ...: the stream's own
        return getattr(self._stream, name)


# vLLM's options that have no equivalent here, and what takes their place: a vLLM command line
# moved over is refused with the way forward, not only "unrecognized arguments".
VLLM_OPTIONS = {
    **{"--" + name.replace("_", "-"): hint for name, hint in VLLM_ENGINE_ARGUMENTS.items()},
    "-tp": VLLM_ENGINE_ARGUMENTS["tensor_parallel_size"],
    "--gpu-memory-utilization": "the KV cache is sized by --kv-cache-gib (default: 80% of the GPU memory the weights "
                                "leave)",
    "--quantization": "a checkpoint's quantization_config says how its weights are quantized (diffuserve quantize "
                      "makes one)",
}


def main(argv=None) -> None:
    root = parser()
    args, unknown = root.parse_known_args(argv)
    if unknown:
        hints = [f"{name} is vLLM's: {VLLM_OPTIONS[name]}" for name in dict.fromkeys(
            arg.split("=", 1)[0] for arg in unknown) if name in VLLM_OPTIONS]
        root.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(f"\n  ({hint})" for hint in hints))
    # A command run with stdout closed (`>&-`, a supervisor's setting): serve, whose log lines
    # go there (uvicorn's formatter asks it isatty), writes them nowhere; the others, whose
    # answer goes there, say so (their answer had been lost, the exit 0).
    if sys.stdout is None:
        if args.command != "serve":
            sys.exit("error: stdout is closed: nowhere to write the answer")
        sys.stdout = open(os.devnull, "w")
    # Text the terminal's encoding cannot show (generated text on a non-UTF-8 locale) comes
    # out as "?" rather than ending the command (stderr already escapes it).
    if hasattr(sys.stdout, "reconfigure"):  # (None where the command runs with stdout closed)
        sys.stdout.reconfigure(errors="replace")
    stderr = sys.stderr  # (put back at the end, for a caller in the same process)
    if not isinstance(stderr, _StatusStream):
        sys.stderr = _StatusStream(stderr)
    try:
        failure = args.run(args)  # (a command's message to exit with, once its objects are gone)
        if sys.stdout is not None:
            sys.stdout.flush()  # here, where a failed write is reported, not at the interpreter's exit
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback, and the shell's code for SIGINT
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, with the shell's code for SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush then goes nowhere
        sys.exit(141)
    except OSError as e:  # the output cannot be written (a full disk), say
        sys.exit(f"error: {e}")
    finally:
        sys.stderr = stderr
    # The command's reference cycles (a model's Python objects, the server's) go now: left to
    # the interpreter's end, they outlived the native module, which nanobind reported as leaked
    # instances after every `serve`.
    gc.collect()
    if failure:
        sys.exit(failure)


if __name__ == "__main__":
    main()
