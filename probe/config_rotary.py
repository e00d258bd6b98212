"""The checks and defaults of a DecoderConfig's rotary fields (config.py calls check_rotary from its __post_init__):
which dimensions rotate, by what base and rescaling, in which layers."""
from __future__ import annotations

from probe.config_choices import Positions, RotaryScaling


def check_rotary(cfg) -> None:
    """Validate `cfg`'s rotary fields, converting a rotary_scaling dict and filling rotary_dim (d_head, or latent
    attention's d_rope), or raise ValueError naming the field and the fix. Called once latent_attention is converted."""
    latent = cfg.latent_attention
    if cfg.rotary_dim is not None and cfg.positions is not Positions.ROTARY:
        raise ValueError(f"rotary_dim={cfg.rotary_dim!r} applies only to positions=rotary (got positions={cfg.positions.value})")
    if isinstance(cfg.rotary_scaling, dict):
        object.__setattr__(cfg, "rotary_scaling", RotaryScaling(**cfg.rotary_scaling))
    if cfg.rotary_scaling is not None and cfg.positions is not Positions.ROTARY:
        raise ValueError(f"rotary_scaling applies only to positions=rotary (got positions={cfg.positions.value})")
    if cfg.rotary_scaling is not None and not isinstance(cfg.rotary_scaling, RotaryScaling):
        raise ValueError(f"rotary_scaling must be a RotaryScaling (or its fields as a dict), got {cfg.rotary_scaling!r}")
    if cfg.positions is Positions.ROTARY:
        if cfg.rotary_dim is None and latent is not None:
            object.__setattr__(cfg, "rotary_dim", latent.d_rope)
        if cfg.rotary_dim is None:
            if cfg.d_head % 2:
                raise ValueError(f"positions=rotary rotates pairs of dimensions, so d_head must be even, got d_head="
                                 f"{cfg.d_head} (or rotate only part of each head: an even rotary_dim below it)")
            object.__setattr__(cfg, "rotary_dim", cfg.d_head)
        if not isinstance(cfg.rotary_dim, int) or isinstance(cfg.rotary_dim, bool) or cfg.rotary_dim <= 0:
            raise ValueError(f"rotary_dim must be a positive int, got {cfg.rotary_dim!r}")
        if cfg.rotary_dim % 2 or cfg.rotary_dim > (cfg.d_head if latent is None else latent.d_qk):
            width = f"d_head={cfg.d_head}" if latent is None else f"latent attention's d_qk={latent.d_qk}"
            raise ValueError(f"positions=rotary rotates pairs of dimensions, so rotary_dim must be even and at most "
                             f"{width}, got rotary_dim={cfg.rotary_dim}")
    scaling = cfg.rotary_scaling
    if scaling is not None and scaling.kind == "longrope":
        if len(scaling.short_factor) != cfg.rotary_dim // 2:
            raise ValueError(f"longrope rotary scaling gives each rotated pair its factors: short_factor and "
                             f"long_factor need rotary_dim // 2 = {cfg.rotary_dim // 2} entries, got "
                             f"{len(scaling.short_factor)}")
        if cfg.rotary_adjacent_pairs or cfg.latent_attention is not None:
            raise ValueError("longrope rotary scaling pairs dimensions i and i + rotary_dim / 2 in ordinary attention: "
                             "set rotary_adjacent_pairs=False and latent_attention=None, or choose another scaling")
    if cfg.rotary_layers is not None:
        layers = tuple(cfg.rotary_layers)
        if cfg.positions is not Positions.ROTARY or len(layers) != cfg.n_layers or not all(
                isinstance(x, bool) for x in layers):
            raise ValueError(f"rotary_layers={cfg.rotary_layers!r} must give each of the n_layers={cfg.n_layers} "
                             "layers True (rotary) or False (no positions), with positions='rotary'")
        object.__setattr__(cfg, "rotary_layers", None if all(layers) else layers)  # one spelling of "every layer"
    if cfg.rotary_adjacent_pairs and cfg.positions is not Positions.ROTARY:
        raise ValueError("rotary_adjacent_pairs applies only to positions=rotary")
    if not isinstance(cfg.rotary_clockwise, bool):
        raise ValueError(f"rotary_clockwise must be a bool, got {cfg.rotary_clockwise!r}")
    if cfg.rotary_clockwise and (cfg.positions is not Positions.ROTARY or cfg.rotary_adjacent_pairs or latent is not None
                                 or (scaling is not None and scaling.kind == "longrope")):
        raise ValueError("rotary_clockwise turns the half-split pairs of ordinary attention the other way (NanoChat's): "
                         "it needs positions='rotary', rotary_adjacent_pairs=False, latent_attention=None and no "
                         "longrope scaling")
    for field in ("rotary_base", "sliding_rotary_base"):
        base = getattr(cfg, field)
        if not (base is None and field == "sliding_rotary_base") and not (isinstance(base, (int, float)) and base > 1):
            raise ValueError(f"{field} must be > 1, got {base!r}")
    dim = cfg.sliding_rotary_dim
    if dim is not None and not (cfg.positions is Positions.ROTARY and cfg.sliding_window is not None and type(dim) is int
                                and 0 < dim <= cfg.d_head and dim % 2 == 0 and cfg.latent_attention is None):
        raise ValueError(f"sliding_rotary_dim={dim!r} is the windowed layers' rotary_dim: an even int up to d_head="
                         f"{cfg.d_head}, with positions='rotary' and a sliding_window; or leave it None")
    if dim == cfg.rotary_dim:  # (one spelling of "the same as the others")
        object.__setattr__(cfg, "sliding_rotary_dim", None)
    if cfg.sliding_rotary_base is not None and not (cfg.positions is Positions.ROTARY and cfg.sliding_window is not None):
        raise ValueError("sliding_rotary_base is the windowed layers' rotary base: it needs positions=rotary and a "
                         "sliding_window; leave it None")

