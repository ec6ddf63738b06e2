"""Session API keys: the key an agent sends names its session and is signed by the run.

A key is ``lmn-<session id>.<signature>``, the signature an HMAC-SHA256 of the session id
under a secret drawn per run (never written anywhere). The gateway recomputes it and
compares in constant time before it looks anything up, so a forged key (a guessed or
altered session id, a key of another run) is refused without touching a session.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

__all__ = ["SessionKeys"]

_PREFIX = "lmn-"


class SessionKeys:
    """Issues and verifies session keys under one secret (a new random one by default)."""

    def __init__(self, secret: bytes | None = None) -> None:
        if secret is not None and len(secret) < 16:
            raise ValueError("the session-key secret must be at least 16 bytes")
        self._secret = secret or secrets.token_bytes(32)

    def _sign(self, session_id: str) -> str:
        mac = hmac.new(self._secret, session_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def issue(self, session_id: str) -> str:
        """The API key of ``session_id``."""
        if not session_id or "." in session_id:
            raise ValueError(f"session id must be non-empty and without '.': {session_id!r}")
        return f"{_PREFIX}{session_id}.{self._sign(session_id)}"

    def session_of(self, key: str) -> str | None:
        """The session id ``key`` was issued for, or ``None`` when it is not a key this
        run signed (malformed, forged, or another run's)."""
        if not key.startswith(_PREFIX) or key.count(".") != 1:
            return None
        session_id, signature = key[len(_PREFIX) :].split(".")
        if not session_id:
            return None
        if not hmac.compare_digest(signature.encode(), self._sign(session_id).encode()):
            return None
        return session_id

    @staticmethod
    def new_session_id() -> str:
        """A fresh, unguessable session id."""
        return secrets.token_hex(12)
