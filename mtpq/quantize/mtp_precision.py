"""The precision an MTP block is held at: ``same`` | ``keep`` | a ggml type, parsed once.

Every boundary that takes this choice from a user — the CLI's ``--mtp-type`` /
``--mtp-experts-type``, a recipe's ``mtp_type`` / ``mtp_experts_type``, ``mtpq
graft`` — turns the text into an :class:`MtpPrecision` with :func:`parse_mtp`,
and everything further in (the policy, ``plan_quantize``, ``plan_graft``) takes
only that typed value, so a raw string never reaches the code that decides types.

Meanings:
- ``same``: no MTP rule; the block's tensors get what the trunk's would (exactly
  llama-quantize). For ``graft``, whose target is already quantized, there is no
  trunk rule to follow, so ``same`` is refused there.
- ``keep``: the block's tensors keep the type they already have (a byte copy
  when grafting; the reference's f16/bf16 when quantizing).
- a ggml type (q8_0, f16, q6_k, ...): every quantizable tensor of the block at
  that type; 1-D tensors and routers stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union

from gguf import GGMLQuantizationType

from ..errors import InputError
from .presets import type_named


class MtpPrecisionKind(str, Enum):
    SAME = "same"
    KEEP = "keep"
    TYPE = "type"


@dataclass(frozen=True)
class MtpPrecision:
    kind: MtpPrecisionKind
    qtype: Optional[GGMLQuantizationType] = None  # set iff kind is TYPE

    def __post_init__(self):
        if (self.kind is MtpPrecisionKind.TYPE) != (self.qtype is not None):
            raise ValueError(f"MtpPrecision({self.kind}, {self.qtype}): a type goes with kind TYPE only")

    def __str__(self) -> str:
        """The user's spelling (recorded in manifests and build keys)."""
        return self.qtype.name.lower() if self.qtype is not None else self.kind.value

    @property
    def is_same(self) -> bool:
        return self.kind is MtpPrecisionKind.SAME

    @property
    def is_keep(self) -> bool:
        return self.kind is MtpPrecisionKind.KEEP


SAME = MtpPrecision(MtpPrecisionKind.SAME)
KEEP = MtpPrecision(MtpPrecisionKind.KEEP)
Q8_0 = MtpPrecision(MtpPrecisionKind.TYPE, GGMLQuantizationType.Q8_0)  # the default: at least as precise as FP8 e4m3


def of_type(qtype: GGMLQuantizationType) -> MtpPrecision:
    return MtpPrecision(MtpPrecisionKind.TYPE, qtype)


def parse_mtp(
    value: Union[str, MtpPrecision, None],
    option: str,
    default: Optional[MtpPrecision] = None,
    allow: tuple[MtpPrecisionKind, ...] = tuple(MtpPrecisionKind),
) -> Optional[MtpPrecision]:
    """Text (or an already parsed value) -> MtpPrecision; ``None`` -> ``default``.

    ``allow`` names the kinds the caller can honour; anything else is an
    InputError naming ``option``.
    """
    if value is None:
        return default
    if isinstance(value, MtpPrecision):
        parsed = value
    else:
        key = value.strip().lower()
        words = {m.value for m in allow if m is not MtpPrecisionKind.TYPE}
        if key in (MtpPrecisionKind.SAME.value, MtpPrecisionKind.KEEP.value):
            parsed = MtpPrecision(MtpPrecisionKind(key))
        else:
            try:
                parsed = of_type(type_named(key, option))
            except InputError as exc:
                if words:
                    raise InputError(option, f"{exc.problem}, or {' or '.join(sorted(words))}") from None
                raise
    if parsed.kind not in allow:
        choices = " or ".join(m.value if m is not MtpPrecisionKind.TYPE else "a ggml type" for m in allow)
        raise InputError(option, f"{str(parsed)!r} is not accepted here; choose {choices}")
    return parsed
