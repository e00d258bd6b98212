"""What every command shares: the common flags, loading the model, safe output, one-line errors."""
from __future__ import annotations

import argparse
import random
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional, Sequence

from probe.cli.output import OPEN, PLOTLY_MODES, SETTINGS, OutputError, fresh_directory
from probe.cli.output import Output as _Output
from probe.cli.text_arguments import non_utf8_argument

DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


def add_common_arguments(parser: argparse.ArgumentParser, *, output: bool = True) -> None:
    from probe import DEFAULT_MODEL

    common = parser.add_argument_group("common options")
    common.add_argument("--model", default=DEFAULT_MODEL,
                        help="hub name (gpt2, pythia-160m, owner/name, ...) or checkpoint directory (default: the bundled model)")
    common.add_argument("--revision", default=None,
                        help="a hub branch, tag or commit of --model, e.g. a Pythia training checkpoint: step3000")
    common.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    common.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model precision")
    if output:
        common.add_argument("--out", default=None, help="output directory (default: probe-out/<command>)")
        common.add_argument("--force", action="store_true",
                            help="write into a non-empty output directory: its files of the same name are replaced, an "
                                 "earlier run's files this one does not write are removed, others are kept and named")
        common.add_argument("--plotly", default="directory", choices=PLOTLY_MODES,
                            help="how each figure page gets plotly.js: one shared plotly.min.js beside the pages, "
                                 "inline in every page (self-contained), or from the CDN (needs network)")
    common.add_argument("--seed", type=int, default=0, help="seed for anything random")
    common.add_argument("--quiet", action="store_true", help="print only results and errors")
    common.add_argument("--debug", action="store_true", help="show the full traceback on errors")


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise CommandError(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:  # torch's message lists twenty device types; ours names the usual ones
        raise CommandError(f"--device {name} is not a device name; use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CommandError(f"--device {name}: CUDA device {device.index} is not available on this machine, which has "
                           f"{torch.cuda.device_count()} (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CommandError(f"--device {name}: MPS is not available on this machine; use --device cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise CommandError(f"--device {name}: probe runs on cpu, cuda or mps")
    return name


def load_model(args: argparse.Namespace):
    import torch

    from probe import HookedDecoder
    from probe.loading import CheckpointError

    try:
        model = HookedDecoder.from_pretrained(args.model, device=resolve_device(args.device),
                                              dtype=getattr(torch, DTYPES[args.dtype]), revision=args.revision)
    except (CheckpointError, FileNotFoundError) as err:
        # the library's advice names its own function; on the command line the way in is --model
        message = str(err).replace("to from_pretrained", "as --model").replace("drop revision=", "drop --revision")
        raise CommandError(f"cannot load --model {args.model}: {message}") from err
    return model.eval()


def sae_directory(name: str) -> str:
    """A --sae value as a directory: a path, or the name of a dictionary shipped for the bundled model
    (`bundled` is its residual SAE, `resid-post-1`; `transcoder-0` ...), when no such path exists."""
    from pathlib import Path

    from probe.sae import BUNDLED_SAES

    shipped = BUNDLED_SAES / ("resid-post-1" if name == "bundled" else name)
    if not Path(name).exists() and "/" not in name and shipped.is_dir():
        return str(shipped)
    return name


def load_sae(model, directory: str):
    """An SAE directory for `model`, checked to read a hook point the model has; a one-line error otherwise."""
    from probe.analyses.features import check_sae
    from probe.hooks import UnknownNameError
    from probe import SparseAutoencoder

    directory = sae_directory(directory)
    try:
        sae = SparseAutoencoder.from_pretrained(directory, device=model.device)
    except (OSError, ValueError) as err:
        raise CommandError(f"cannot load --sae {directory}: {err}") from err
    try:
        check_sae(model, sae)
    except (UnknownNameError, ValueError) as err:
        raise CommandError(f"--sae {directory}: {err}") from err
    return sae


def checked(flag: str, check, *args):
    """The library's own check of a flag's value, run before any work; its ValueError as a one-line error."""
    try:
        return check(*args)
    except ValueError as err:
        raise CommandError(f"{flag}: {err}") from err


def check_corpus_arg(corpus) -> None:
    """--corpus read as far as its first piece before any work (a one-line error), as the scan will read it."""
    from probe.analyses.corpus import check_corpus

    if corpus is not None and not Path(corpus).exists():
        raise CommandError(f"--corpus {corpus} does not exist")
    try:
        check_corpus(corpus)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise CommandError(f"--corpus {corpus}: {err}" if corpus is not None else str(err)) from err


def write_triggers(out: "Output", args: argparse.Namespace, model, triggers):
    """triggers.csv for a complete scan (and the partial file of an earlier run removed); for one stopped by
    Ctrl-C, triggers.partial.csv and the report, saying what is stale and how to finish. Returns the frame
    written for a complete scan (decoding every context is not free), None for an interrupted one."""
    frame = triggers.to_frame(model)
    if not triggers.complete:  # keep what was scanned, under a name that says it is partial
        out.write_csv("triggers.partial.csv", frame)
        out.keep("triggers.csv", "triggers.html")  # an earlier complete result stays (named below) until one replaces it
        out.report(args)
        for stale in ("triggers.csv", "triggers.html"):
            if out.final(stale).exists():
                print(f"note: {out.final(stale)} is from an earlier, complete run, not this one", file=sys.stderr)
        print(f"interrupted: the scan covered {triggers.n_tokens} tokens ({triggers.n_docs} documents complete); "
              f"triggers.partial.csv holds their top-{triggers.k}; rerun to scan the whole corpus", file=sys.stderr)
        return None
    out.write_csv("triggers.csv", frame)
    out.discard("triggers.partial.csv")
    return frame


def model_label(args: argparse.Namespace) -> str:
    """--model as given, with @revision when one was asked for (two Pythia steps are two different models)."""
    return str(args.model) + (f"@{args.revision}" if getattr(args, "revision", None) else "")


def log(args: argparse.Namespace, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(message, file=sys.stderr)


class Output(_Output):
    """An output directory owned by this run, published whole at the end (see scripts.output)."""

    def __init__(self, directory: Path, force: bool):
        try:
            super().__init__(directory, force, created=Path(directory) in _FRESH)
        except OutputError as err:
            raise CommandError(str(err)) from None


_FRESH: set[Path] = set()  # directories default_out made for this run (removed again if it fails before writing)


def default_out(args: argparse.Namespace, command: str) -> Path:
    """--out, else probe-out/<command>; `probe report` gets a fresh timestamped directory each run instead."""
    if args.out:
        return Path(args.out)
    if command == "report":
        try:
            directory = fresh_directory(Path("probe-out") / command)
        except (OutputError, OSError) as err:
            raise CommandError(f"cannot make an output directory: {err}; pass --out") from None
        _FRESH.add(directory)
        return directory
    return Path("probe-out") / command


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a usage error otherwise, before anything runs or is written)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def fraction(text: str, below_one: bool = False) -> float:
    """An argparse type: a number in (0, 1] (`below_one`: (0, 1), for a share that must leave something)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (0 < value < 1 if below_one else 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1{')' if below_one else ']'}: a fraction")
    return value


def fraction_below_one(text: str) -> float:
    return fraction(text, below_one=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM (kill, timeout, schedulers, container stops), raised where Ctrl-C would be: the same clean-up runs."""


@contextmanager
def terminate_as_interrupt():
    """For the block, SIGTERM raises Terminated in the main thread, as SIGINT raises KeyboardInterrupt. Yields a
    list that holds True once a SIGTERM came (a library that stops cleanly on an interrupt swallows it)."""
    import signal
    import threading

    received: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def raise_terminated(signum, frame):
        received.append(True)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_command(run: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> int:
    """Parse, run, and turn failures into one line and a non-zero exit (a traceback only with --debug).
    SIGTERM is handled as Ctrl-C: partial results are named as such, temporary files removed; exit 143."""
    args = parser.parse_args(argv)
    SETTINGS.quiet, SETTINGS.plotly = bool(getattr(args, "quiet", False)), getattr(args, "plotly", None) or "directory"
    try:
        try:
            with terminate_as_interrupt() as terminated:
                problem = non_utf8_argument(args)
                if problem:
                    raise CommandError(problem)
                seed_everything(args.seed)
                code = run(args)
        except BaseException as err:  # the run's output directories are left as they were before it
            why = "terminated" if isinstance(err, Terminated) else "interrupted" if isinstance(err, KeyboardInterrupt) \
                else "failed"
            for out in list(OPEN):
                out.abort(why)
            raise
        for out in list(OPEN):  # a command that returned without publishing (an early exit) still publishes
            out.report(args)
        if terminated:
            print("terminated (SIGTERM)", file=sys.stderr)
            return 143
        return code
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except CommandError as err:
        return _fail(args, str(err))
    except (ValueError, TypeError, KeyError, FileNotFoundError, OSError, MemoryError) as err:
        return _fail(args, str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err))
    except RuntimeError as err:
        import torch

        if not isinstance(err, torch.cuda.OutOfMemoryError):  # other RuntimeErrors are bugs: show their traceback
            raise
        return _fail(args, f"out of memory on --device {args.device}: {err}; try shorter or fewer prompts, "
                           "--dtype bfloat16, or --device cpu")


def _fail(args: argparse.Namespace, message: str) -> int:
    """The error as one line: library messages may span lines (the hub's do), and a log line must not."""
    if args.debug:
        traceback.print_exc()
    print("error: " + " ".join(line.strip() for line in message.splitlines() if line.strip()), file=sys.stderr)
    return 2


def check_contrast(model, answer: int, counterfactual: Optional[int]) -> None:
    """A logit difference against the answer itself is zero everywhere, which would read as a finding."""
    if counterfactual == answer:
        shown = model.tokenizer.token_strings([answer])[0] if model.tokenizer is not None else str(answer)
        raise CommandError(f"--counterfactual is the same token as the answer (id {answer}, {shown!r}); give a different one")


def token_id(model, value: str, flag: str) -> int:
    """A token given on the command line, naming a logit: an integer id, or text that is exactly one token."""
    if value.isascii() and value.lstrip("-").isdigit():  # not str.isdigit alone: '²' is a digit to it, not to int()
        token = int(value)
        if not 0 <= token < model.cfg.d_vocab_out:
            raise CommandError(f"{flag} {token} is not an output token id in [0, {model.cfg.d_vocab_out})")
        return token
    ids = model._require_tokenizer().encode(value, add_special_tokens=False)
    if len(ids) != 1:
        pieces = model.tokenizer.token_strings(ids)
        raise CommandError(f"{flag} {value!r} is {len(ids)} tokens {pieces}; give one token (mind the leading space) or its id")
    if ids[0] >= model.cfg.d_vocab_out:
        raise CommandError(f"{flag} {value!r} is token {ids[0]}, which the model never predicts (its logits stop at "
                           f"{model.cfg.d_vocab_out}); give an output token")
    return ids[0]


def parse_heads(text: str, model) -> list[tuple[int, int]]:
    """'L3H1,L4H0' (or '3.1,4.0', 'a3.1') -> [(3, 1), (4, 0)], each checked against the model."""
    from probe.analyses.labels import parse_head

    heads = []
    for item in text.split(","):
        try:
            layer, head = parse_head(item)
        except ValueError:
            raise CommandError(f"--heads {text!r}: write heads as L3H1 (or 3.1), comma-separated, e.g. L3H1,L4H0") from None
        if not 0 <= layer < model.cfg.n_layers:
            raise CommandError(f"--heads: layer {layer} is outside [0, {model.cfg.n_layers})")
        if not 0 <= head < model.cfg.layer_heads(layer):
            raise CommandError(f"--heads: head {head} is outside [0, {model.cfg.layer_heads(layer)}) in layer {layer}")
        heads.append((layer, head))
    return heads


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module's docstring as written, and each flag's default after its help where it has a meaningful one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        meaningful = not (default is None or default is False or default is argparse.SUPPRESS or default in ([], ""))
        if action.option_strings and meaningful and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def command(module_doc: str, prog: str, add_arguments: Callable[[argparse.ArgumentParser], None],
            run: Callable[[argparse.Namespace], int]):
    """(build_parser, main) for a subcommand: its own flags, then the common ones."""

    def build_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=module_doc, formatter_class=HelpFormatter)
        add_arguments(parser)
        add_common_arguments(parser)
        return parser

    def main(argv: Optional[Sequence[str]] = None) -> int:
        return run_command(run, build_parser(), argv)

    return build_parser, main


def check_prompt(model, prompt: str) -> None:
    n = model.to_tokens(prompt).shape[1]
    if n > model.cfg.n_ctx:
        raise CommandError(f"the prompt is {n} tokens but the model's context is {model.cfg.n_ctx}; shorten it")


def read_prompts_file(path: str, flag: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file, one prompt each."""
    file = Path(path)
    if not file.is_file():
        raise CommandError(f"{flag} {file} does not exist")
    try:
        prompts = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as err:
        raise CommandError(f"{flag} {file} is not UTF-8 text ({err.reason} at byte {err.start})") from err
    if not prompts:
        raise CommandError(f"{flag} {file} holds no prompts (one per line)")
    return prompts


def check_position(model, prompt: str, position: int, flag: str = "--position") -> None:
    n = model.to_tokens(prompt).shape[1]
    if not -n <= position < n:
        raise CommandError(f"{flag} {position} is outside the prompt's {n} tokens (BOS included): use {-n} to {n - 1}")
