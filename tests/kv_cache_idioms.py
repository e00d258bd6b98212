"""transformer-lens code that runs its own generation loop on the key/value cache, written once: the oracle
(tests/saelens_oracle.py `kv_cache_loop`, HookedTransformer of transformer-lens 3 with its TransformerLensKeyValueCache)
and tests/test_kv_cache.py (probe, with probe.TransformerLensKeyValueCache) each run `kv_cache_idioms` on a model
built from the same config with the same weights. Attribute access only; the cache class is passed in."""
from __future__ import annotations

import torch


def kv_cache_idioms(model, cache_class, tokens: torch.Tensor) -> dict:
    out = {}
    batch = tokens.shape[0]
    with torch.no_grad():
        # greedy decoding by hand: the prompt once, then one token at a time
        cache = cache_class.init_cache(model.cfg, model.cfg.device, batch)
        logits = model(tokens, past_kv_cache=cache)
        out["prompt_logits"] = logits
        chosen = []
        for step in range(4):
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            chosen.append(next_token)
            logits = model(next_token, past_kv_cache=cache)
            out[f"step{step}_logits"] = logits
        out["generated"] = torch.cat(chosen, dim=1)

        # one frozen prefix, several continuations; unfrozen, the cache grows again
        prefix = cache_class.init_cache(model.cfg, model.cfg.device, batch)
        model(tokens[:, :3], past_kv_cache=prefix)
        prefix.freeze()
        out["continuation_a"] = model(tokens[:, 3:], past_kv_cache=prefix)
        out["continuation_b"] = model(tokens[:, 3:5], past_kv_cache=prefix)
        prefix.unfreeze()
        out["grown_c"] = model(tokens[:, 3:4], past_kv_cache=prefix)
        out["grown_d"] = model(tokens[:, 4:6], past_kv_cache=prefix)

        # hooks and caches see the new positions only, attending to every cached one
        held = cache_class.init_cache(model.cfg, model.cfg.device, batch)
        model(tokens[:, :4], past_kv_cache=held)
        logits, activations = model.run_with_cache(tokens[:, 4:6], past_kv_cache=held)
        out["cached_run_logits"] = logits
        out["cached_run_pattern"] = activations["pattern", 0]
        out["cached_run_resid"] = activations["resid_post", 0]

        def zero_head_0(z, hook):
            z[:, :, 0] = 0.0
            return z

        out["hooked_step"] = model.run_with_hooks(tokens[:, 6:7], past_kv_cache=held,
                                                  fwd_hooks=[("blocks.0.attn.hook_z", zero_head_0)])
    return out
