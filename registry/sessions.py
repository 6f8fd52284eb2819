"""Member sessions: the secret an accepted Register hands out, and the proof made with it.

A proved message (Heartbeat, Bye, Report) ends with its `proof` field: keyed BLAKE2b, cut
to 128 bits, over every byte of the encoded message before the proof's own 16 bytes. A
standard MAC (RFC 7693, keyed mode) from the standard library. It binds every field, the
`seq` included, so a proof cannot be moved to another message and a message cannot be
replayed (the registry keeps the last `seq` it accepted). It rides in the message's one
frame: a second frame would cost the registry's loop more than the MAC itself.

BLAKE2b rather than HMAC-SHA256 because it is ~10x cheaper in CPython (about 0.6 us
against 6 us a message): the heartbeat path is the registry's hot loop.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Final

import msgspec

from wire.limits import NO_PROOF, PROOF_BYTES
from wire.protocol import Sync

__all__ = ["NONCE_BYTES", "PROOF_BYTES", "SESSION_BYTES", "new_nonce", "new_session",
           "open_session", "prove_sync", "register_proof", "seal", "seal_session",
           "sync_proof", "token_key", "token_lines", "verify"]

SESSION_BYTES: Final = 32  # 256 random bits per member and registry
NONCE_BYTES: Final = 16
SALT_BYTES: Final = 16


def new_session() -> bytes:
    return secrets.token_bytes(SESSION_BYTES)


def new_nonce() -> bytes:
    """A registrant's own secret for one process life (see `Register.nonce`)."""
    return secrets.token_bytes(NONCE_BYTES)


_blake2b = hashlib.blake2b
_compare = hmac.compare_digest


def seal(session: bytes, payload: bytes) -> bytes:
    """`payload` (an encoded message whose `proof` is still NO_PROOF) with its proof."""
    if not payload.endswith(NO_PROOF):
        raise ValueError("seal() takes an encoded message whose proof is NO_PROOF")
    signed = payload[:-PROOF_BYTES]
    return signed + _blake2b(signed, key=session, digest_size=PROOF_BYTES).digest()


def verify(session: bytes, payload: bytes, proof: bytes) -> bool:
    """Whether `proof`, the message's own last field, seals `payload`. Constant time.

    On the registry's hot path: one call, no helpers.
    """
    return _compare(_blake2b(payload[:-PROOF_BYTES], key=session,
                             digest_size=PROOF_BYTES).digest(), proof)


# --- the fleet token as a key (Register) ----------------------------------------------
#
# A Register proves the fleet token without carrying it: `register_proof` is keyed
# BLAKE2b with the token over the encoded Register (proof left at NO_PROOF). The registry
# seals the session of its reply with the token too: XOR with keyed BLAKE2b of (nonce,
# a fresh salt), a one-time pad per reply. So a Register sniffed and replayed returns a
# session only a token holder can open, and the token itself never crosses the wire.
# (Against a token holder who also sniffs the wire, CURVE is the answer.)


def token_key(token: str) -> bytes:
    """The fleet token as a 32-byte BLAKE2b key (a token may be longer than a key)."""
    return _blake2b(token.encode(), digest_size=32, person=b"pdreg-token").digest()


def register_proof(key: bytes, unsealed: bytes) -> bytes:
    """The proof of a Register: `unsealed` is its encoding with proof = NO_PROOF."""
    return _blake2b(unsealed, key=key, digest_size=PROOF_BYTES,
                    person=b"pdreg-register").digest()


def sync_proof(key: bytes, unsealed: bytes) -> bytes:
    """The proof of a Sync (a read): the same construction, its own personalization, so
    a Register's proof never passes for a Sync's or back."""
    return _blake2b(unsealed, key=key, digest_size=PROOF_BYTES, person=b"pdreg-sync").digest()


def prove_sync(sync: Sync, token: str, encode: Callable[[object], bytes]) -> Sync:
    """`sync` with the proof of `token` (unchanged without a token)."""
    if not token:
        return sync
    proof = sync_proof(token_key(token), encode(sync))
    return msgspec.structs.replace(sync, proof=proof)


def new_salt() -> bytes:
    return secrets.token_bytes(SALT_BYTES)


def _pad(key: bytes, nonce: bytes, salt: bytes, size: int) -> bytes:
    return _blake2b(nonce + salt, key=key, digest_size=size, person=b"pdreg-session").digest()


def seal_session(key: bytes, nonce: bytes, salt: bytes, session: bytes) -> bytes:
    """`session` as only a holder of the token (and `nonce`) can read it."""
    pad = _pad(key, nonce, salt, len(session))
    return bytes(a ^ b for a, b in zip(session, pad, strict=True))


open_session = seal_session  # XOR with the same pad: sealing twice opens


def token_lines(text: str) -> list[str]:
    """The tokens in `text`, one per line: a registry accepts every one of them (the old
    and the new while they rotate); a client sends the first (`pdreg.args.secret_of`)."""
    return [line.strip() for line in text.splitlines() if line.strip()]
