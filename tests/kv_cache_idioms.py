"""transformer-lens code that runs its own generation loop on the key/value cache, and TL 3.9's generate_stream,
written once: the oracle
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
        out["empty_mask_shape"] = torch.tensor(prefix.previous_attention_mask.shape)  # auto_circuit keys caches so
        model(tokens[:, :3], past_kv_cache=prefix)
        prefix.freeze()
        out["prefix_mask"] = prefix.previous_attention_mask
        out["continuation_a"] = model(tokens[:, 3:], past_kv_cache=prefix)
        out["continuation_b"] = model(tokens[:, 3:5], past_kv_cache=prefix)
        out["frozen_mask"] = prefix.previous_attention_mask
        prefix.unfreeze()
        out["grown_c"] = model(tokens[:, 3:4], past_kv_cache=prefix)
        out["grown_d"] = model(tokens[:, 4:6], past_kv_cache=prefix)
        out["grown_mask"] = prefix.previous_attention_mask

        # auto_circuit's ACDC over a frozen shared prefix: input_to_embed after the cache, then each layer rerun from
        # a cached residual with every position's mask
        shared = cache_class.init_cache(model.cfg, model.cfg.device, batch)
        model(tokens[:, :3], past_kv_cache=shared)
        shared.freeze()
        out["appended_mask"] = shared.append_attention_mask(torch.ones_like(tokens[:, :2]))  # frozen: kept apart
        residual, new_tokens, _, mask = model.input_to_embed(tokens[:, 3:], past_kv_cache=shared)
        out["embed_after_cache"], out["embed_mask"] = residual, mask
        _, run = model.run_with_cache(tokens[:, 3:], past_kv_cache=shared)
        for layer in range(model.cfg.n_layers):
            out[f"from_layer_{layer}"] = model(run[f"blocks.{layer}.hook_resid_pre"], start_at_layer=layer,
                                               tokens=new_tokens, attention_mask=mask, past_kv_cache=shared)
        # unfrozen, input_to_embed keeps the new mask and the run from its residual keeps the new keys
        growing = cache_class.init_cache(model.cfg, model.cfg.device, batch)
        model(tokens[:, :3], past_kv_cache=growing)
        residual, _, _, mask = model.input_to_embed(tokens[:, 3:5], past_kv_cache=growing)
        out["grown_embed_mask"] = growing.previous_attention_mask
        out["from_embed"] = model(residual, start_at_layer=0, attention_mask=mask, past_kv_cache=growing)
        out["after_from_embed"] = model(tokens[:, 5:7], past_kv_cache=growing)

        # padded batches into a cache (TL's test_multi_token_batch): pad ids (0) on either side of a prompt or of a
        # continuation are padding, the padding side's run of them
        pad = torch.zeros_like(tokens)
        left_prompt = torch.cat([pad[:, :2], tokens[:, :3]], dim=1)
        left_prompt[0, :2] = tokens[0, 5:7]
        right_prompt = torch.cat([tokens[:, :3], pad[:, :2]], dim=1)
        right_prompt[1, 3:] = tokens[1, 5:7]
        left_more, right_more = torch.cat([pad[:, :1], tokens[:, 3:5]], dim=1), torch.cat([tokens[:, 3:5], pad[:, :1]], dim=1)
        left_more[1, 0] = tokens[1, 6]
        right_more[0, 2] = tokens[0, 6]
        for prompt_side, prompt in (("left", left_prompt), ("right", right_prompt)):
            for more_side, more in (("left", left_more), ("right", right_more)):
                padded = cache_class.init_cache(model.cfg, model.cfg.device, batch)
                model(prompt, past_kv_cache=padded, padding_side=prompt_side)
                padded.freeze()
                logits = model(more, past_kv_cache=padded, padding_side=more_side, prepend_bos=False)
                # a padding position's own output means nothing, and differs: probe lets a padded query see itself
                out[f"padded_{prompt_side}_{more_side}"] = logits * (more != 0)[..., None]
                out[f"padded_{prompt_side}_{more_side}_mask"] = padded.previous_attention_mask

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

        # TL 3.9's streaming generate: token ids in chunks as they come (greedy, which both sides can agree on)
        chunks = list(model.generate_stream(tokens[:1, :5], max_new_tokens=7, max_tokens_per_yield=3, do_sample=False,
                                            stop_at_eos=False, verbose=False))
        out["stream_chunk_lengths"] = torch.tensor([chunk.shape[1] for chunk in chunks])
        out["stream"] = torch.cat(chunks, dim=1)
        stop = int(out["stream"][0, 8])  # a token the greedy run emits: a run stopping there ends early
        chunks = list(model.generate_stream(tokens[:1, :2], max_new_tokens=9, max_tokens_per_yield=4, do_sample=False,
                                            eos_token_id=stop, verbose=False))
        out["stream_stopped_lengths"] = torch.tensor([chunk.shape[1] for chunk in chunks])
        out["stream_stopped"] = torch.cat(chunks, dim=1)
    return out
