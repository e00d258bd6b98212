"""The quickstart: load the bundled model, run a prompt, read and edit activations.

    python scripts/quickstart.py [--model DIR_OR_NAME] [--prompt TEXT]
"""
from __future__ import annotations

import argparse
import sys

import torch


from probe import DEFAULT_MODEL, HookedDecoder


def top_tokens(model: HookedDecoder, logits: torch.Tensor, k: int = 5) -> str:
    probs = logits.float().softmax(-1)
    values, ids = probs.topk(k)
    return ", ".join(f"{model.tokenizer.decode([i])!r} {p:.2f}" for p, i in zip(values.tolist(), ids.tolist()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory or hub name (default: the bundled model)")
    parser.add_argument("--revision", default=None, help="a hub branch, tag or commit of --model (e.g. a Pythia step)")
    parser.add_argument("--prompt", default="ROMEO.\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the")
    args = parser.parse_args(argv)

    model = HookedDecoder.from_pretrained(args.model, revision=args.revision).eval()
    print(f"model: {args.model}\n  {model.cfg.n_layers} layers, d_model {model.cfg.d_model}, {model.cfg.n_heads} heads, "
          f"{model.ledger().total_params:,} parameters, {len(model.hook_names)} hook points")

    with torch.no_grad():
        logits, cache = model.run_with_cache(args.prompt)
    print(f"\nprompt: {args.prompt!r} ({logits.shape[1]} tokens)")
    print(f"next token: {top_tokens(model, logits[0, -1])}")
    print(f"cached {len(cache)} activations, {cache.nbytes / 2**20:.2f} MiB, e.g. "
          f"blocks.0.attn.hook_pattern {tuple(cache['blocks.0.attn.hook_pattern'].shape)}")

    # Which head matters most for the next token? Zero each head's output in turn.
    target = int(logits[0, -1].argmax())
    effects = []
    with torch.no_grad():
        for layer in range(model.cfg.n_layers):
            for head in range(model.cfg.layer_heads(layer)):  # a pruned model's layers differ
                def zero_head(z, hook, head=head):
                    z = z.clone()
                    z[:, :, head] = 0.0
                    return z

                ablated = model.run_with_hooks(args.prompt, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", zero_head)])
                drop = (logits[0, -1].log_softmax(-1)[target] - ablated[0, -1].log_softmax(-1)[target]).item()
                effects.append((drop, layer, head))
    drop, layer, head = max(effects)
    print(f"\nzeroing head L{layer}H{head} lowers log p({model.tokenizer.decode([target])!r}) the most: by {drop:.3f} nats")

    print("\ngreedy continuation:")
    print(model.generate(args.prompt, max_new_tokens=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
