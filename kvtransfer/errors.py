"""Errors of the KV link itself (payloads and layouts); transport and protocol errors are
pdserve.control.errors."""

from __future__ import annotations

from pdserve.control.errors import ProtocolError, WireError


class KVTransferError(WireError):
    """Base of the KV link's own errors."""

    code = "kv_transfer_error"


class ChecksumMismatchError(ProtocolError, KVTransferError):
    """A payload whose checksum differs from the one its header promised (corrupted in flight)."""

    code = "checksum_mismatch"


class LayoutMismatchError(KVTransferError):
    """Two engines whose KV layouts differ; `differences` names each differing field."""

    code = "layout_mismatch"

    def __init__(self, message: str, differences: list[str]):
        super().__init__(message)
        self.differences = differences


class WeightsHashError(KVTransferError, ValueError):
    """A path that holds no readable safetensors weights to fingerprint."""

    code = "weights_unreadable"
