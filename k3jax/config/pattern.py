"""The layer-pattern mini-language: "23*(kda,kda,kda,mla) + mla" -> 93 mixer names."""

from __future__ import annotations

import re

MIXERS = ("softmax", "linear", "deltanet", "gated_deltanet", "kda", "mla")

_TERM = re.compile(r"^(?:(\d+)\s*\*\s*)?(?:\(([^()]*)\)|([a-z_]+))$")


def parse_layer_pattern(pattern: str) -> tuple[str, ...]:
    """Expand a pattern into one mixer name per layer.

    Grammar: terms joined by '+'; a term is `name`, `N*name` or `N*(a,b,...)`.
    Raises ValueError naming the bad term or mixer.
    """
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError("layer_pattern is empty")
    layers: list[str] = []
    for raw in pattern.split("+"):
        term = raw.strip()
        m = _TERM.match(term)
        if not m:
            raise ValueError(f"cannot parse term {term!r} of layer_pattern {pattern!r}; "
                             "use e.g. '23*(kda,kda,kda,mla) + mla'")
        count = int(m.group(1) or 1)
        names = [n.strip() for n in (m.group(2) if m.group(2) is not None else m.group(3)).split(",")]
        for n in names:
            if n not in MIXERS:
                raise ValueError(f"unknown mixer {n!r} in layer_pattern; choose from {', '.join(MIXERS)}")
        if count <= 0:
            raise ValueError(f"repeat count must be positive in term {term!r}")
        layers += names * count
    return tuple(layers)
