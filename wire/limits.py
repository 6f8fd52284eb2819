"""The wire's bounds: size limits and the constrained types every message field uses.

The limits bound memory per member and make hostile input cheap to refuse; the
`Annotated` types carry them, so msgspec checks them on every decode.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

# Size limits. They bound memory per member and make hostile input cheap to refuse.
MAX_MESSAGE_BYTES: Final = 64 * 1024  # also set as ZMQ_MAXMSGSIZE on the control socket
MAX_ID_CHARS: Final = 128
MAX_NAME_CHARS: Final = 256
MAX_URL_CHARS: Final = 512
MAX_LABELS: Final = 32
MAX_ADAPTERS: Final = 64  # LoRA adapters one member serves besides its base model
MAX_LABEL_CHARS: Final = 128
MAX_EXTRA_LOAD_FIELDS: Final = 16
MAX_TOKEN_CHARS: Final = 256
PROOF_BYTES: Final = 16  # the last bytes of a proved message (registry.sessions)
NO_PROOF: Final = bytes(PROOF_BYTES)  # what a message carries until it is sealed
NONCE_MIN_BYTES: Final = 16
NONCE_MAX_BYTES: Final = 64
MAX_PROBLEM_CHARS: Final = 256
MAX_LOAD_FIGURE: Final = 1e15  # load.extra values; also keeps NaN and infinities out
MAX_UNIX_TIME_S: Final = 1e11  # year 5138: a bound, so a float field cannot be inf or NaN

# Types bound sizes and ranges, which are cheap to check on every decode. Character
# patterns cost a regex per field, so they are checked once, at registration
# (`validate_spec`), not on every heartbeat and snapshot.
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
MemberId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Host = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Url = Annotated[str, msgspec.Meta(max_length=MAX_URL_CHARS)]
LabelText = Annotated[str, msgspec.Meta(max_length=MAX_LABEL_CHARS)]
Labels = Annotated[dict[LabelText, LabelText], msgspec.Meta(max_length=MAX_LABELS)]
Adapters = Annotated[tuple[Name, ...], msgspec.Meta(max_length=MAX_ADAPTERS)]  # LoRA names
Incarnation = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Token = Annotated[str, msgspec.Meta(max_length=MAX_TOKEN_CHARS)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=NONCE_MIN_BYTES, max_length=NONCE_MAX_BYTES)]
Session = Annotated[bytes, msgspec.Meta(max_length=64)]
Proof = Annotated[bytes, msgspec.Meta(min_length=PROOF_BYTES, max_length=PROOF_BYTES)]
# Every float carries bounds: msgspec checks them on decode, and NaN fails any bound, so
# no NaN or infinity gets in (it would break JSON for the dashboard and `pdreg status`).
Fraction = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
LoadFigure = Annotated[float, msgspec.Meta(ge=-MAX_LOAD_FIGURE, le=MAX_LOAD_FIGURE)]
UnixTime = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_UNIX_TIME_S)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_UNIX_TIME_S)]
Interval = Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]
