"""probe tokens: how a prompt tokenises: each position's id and string, whitespace shown (␣ space, ⏎ newline).

Positions count the BOS token the model puts first (as every other command's positions do). A token
holding part of a UTF-8 character shows its bytes (`<0xE2>`). tokens.csv has the raw strings too.

examples:
  probe tokens --prompt "ROMEO. But soft, what light"
  probe tokens --prompt "Romeo, Romeo, Romeo," --prompt "Juliet, Juliet, Juliet,"   # two prompts: equal lengths?
  probe tokens --prompt " Romeo" --no-bos                                          # is an answer one token?
"""
from __future__ import annotations

import argparse
import sys


from probe.cli.common import CommandError, Output, command, default_out, load_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--no-bos", action="store_true", help="tokenise the text alone, without the BOS token (as an --answer is)")


def token_table(model, prompts, *, bos: bool = True):
    """One row per token of each prompt: prompt (its index), position, id, token (the string as decoded,
    or its bytes as `<0xE2>`), shown (whitespace made visible)."""
    import pandas as pd

    from probe.analyses.labels import shown_token, token_texts

    tokenizer = model._require_tokenizer()
    rows = []
    for index, prompt in enumerate(prompts):
        ids = model.to_tokens(prompt)[0].tolist() if bos else tokenizer.encode(prompt, add_special_tokens=False)
        for position, (token_id, text) in enumerate(zip(ids, token_texts(tokenizer, ids))):
            rows.append(dict(prompt=index, position=position, id=token_id, token=text, shown=shown_token(text)))
    return pd.DataFrame(rows, columns=["prompt", "position", "id", "token", "shown"])


def describe(model, text: str, *, bos: bool = True) -> str:
    """`12 tokens: <|endoftext|> | Romeo | , | ␣Romeo ...`: how `text` tokenises, for an error message."""
    frame = token_table(model, [text], bos=bos)
    return f"{len(frame)} token{'s' * (len(frame) != 1)}: " + " | ".join(frame.shown)


def terminal_table(frame) -> str:
    """The table as printed: position, id and the visible string, one prompt after another."""
    blocks = []
    for index, rows in frame.groupby("prompt", sort=True):
        lines = [f"prompt {index}: {len(rows)} tokens", f"{'pos':>5}  {'id':>7}  token"]
        lines += [f"{r.position:>5}  {r.id:>7}  {r.shown}" for r in rows.itertuples()]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def run(args: argparse.Namespace) -> int:
    out = Output(default_out(args, "tokens"), args.force)
    model = load_model(args)
    if model.tokenizer is None:
        raise CommandError(f"--model {args.model} has no tokenizer, so there is nothing to show")
    frame = token_table(model, args.prompt, bos=not args.no_bos)
    out.write_csv("tokens.csv", frame)
    print(terminal_table(frame))
    lengths = frame.groupby("prompt").size().tolist()
    if len(lengths) > 1:
        print("\nthe prompts tokenise to " + ("the same length" if len(set(lengths)) == 1 else "different lengths: "
                                             + ", ".join(map(str, lengths))))
    out.report(args)
    return 0


build_parser, main = command(__doc__, "probe tokens", add_arguments, run)

if __name__ == "__main__":
    sys.exit(main())
