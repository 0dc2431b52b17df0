"""Messages of the KV link between a decode engine (D) and a prefill engine (P).

    D -> P   Hello (layout fingerprint), KVHold (keep this request's KV for me), KVWant (send it)
    P -> D   HelloAck, KVLayer (+ one payload frame) per layer range, KVDone
    D -> P   KVAck
    either   Abort, Error (pdserve.control.messages: both planes use them)

Schemas and bounds: pdserve.control.schema. Payload layout and checksums: kvtransfer.payload.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import Field, model_validator

from pdserve.control.errors import ProtocolError
from pdserve.control.messages import Incarnation
from pdserve.control.protocol import as_buffer
from pdserve.control.schema import (
    MAX_CHECKSUM,
    MAX_DICT_ITEMS,
    MAX_FRAME_BYTES,
    MAX_ID_LEN,
    MAX_LAYERS,
    MAX_LOGPROBS,
    MAX_SHAPE_DIMS,
    MAX_TOKENS,
    Message,
    Role,
    TokenId,
    max_items,
)
from pdserve.kvtransfer.errors import ChecksumMismatchError
from pdserve.kvtransfer.payload import DTYPE_SIZES, KVDtype, dtype_name, payload_checksum, tensor_from_frame

FrameDim = Annotated[int, Field(ge=1, le=MAX_FRAME_BYTES)]  # one dimension of a payload's shape


class Hello(Message, type_name="hello"):
    """Client -> server, first on a link: who I am and the KV layout I hold (LayoutFingerprint)."""

    fingerprint: Annotated[dict[str, str | int], max_items(MAX_DICT_ITEMS)]
    role: Role
    engine_id: str = Field(max_length=MAX_ID_LEN)
    incarnation: Incarnation = ""  # the client process's: a new one from the same engine_id is a restart


class HelloAck(Message, type_name="hello_ack"):
    """Server -> client: the link is accepted, or refused with the reason (e.g. layout differences), and
    which incarnation of the server process answered."""

    ok: bool
    reason: str = ""
    incarnation: Incarnation = ""


class KVHold(Message, type_name="kv_hold"):
    """D -> P, when a request that P prefills reaches D: D has it queued and will ask for its KV (KVWant)
    once it has blocks for it, or abort it. P keeps the computed prompt's blocks for it up to
    --kv-hold-timeout rather than --kv-want-timeout, which is for prompts no decode engine has claimed."""

    request_id: str = Field(max_length=MAX_ID_LEN)


class KVWant(Message, type_name="kv_want"):
    """D -> P: send the KV of prompt tokens [skip_tokens, skip_tokens + num_tokens) of a request.

    skip_tokens is D's own prefix-cache hit (block aligned); skip_tokens + num_tokens is the prompt
    length, which P checks against the prompt it was given."""

    request_id: str = Field(max_length=MAX_ID_LEN)
    skip_tokens: int = Field(ge=0, le=MAX_TOKENS)
    num_tokens: int = Field(ge=1, le=MAX_TOKENS)


class KVLayer(Message, type_name="kv_layer", max_frames=1):
    """P -> D: KV of layers [layer_start, layer_end) for tokens [token_start, token_start + num_tokens),
    in one payload frame of `nbytes` bytes shaped `shape` in `dtype`, with its payload_checksum.

    token_start lets chunked prefill send one layer range in several token chunks, and a sliding-window
    layer's KV start at its window (kvtransfer/layout.py)."""

    request_id: str = Field(max_length=MAX_ID_LEN)
    layer_start: int = Field(ge=0, le=MAX_LAYERS - 1)
    layer_end: int = Field(ge=1, le=MAX_LAYERS)
    token_start: int = Field(ge=0, le=MAX_TOKENS)
    num_tokens: int = Field(ge=1, le=MAX_TOKENS)
    dtype: KVDtype
    # [num_layers, planes, num_tokens, num_kv_heads, head_dim], checked by check_layout; planes 2 is K and V,
    # 1 a latent (MLA: [.., 1, width])
    shape: Annotated[tuple[FrameDim, ...], max_items(MAX_SHAPE_DIMS)]
    nbytes: int = Field(ge=1, le=MAX_FRAME_BYTES)
    checksum: int = Field(ge=0, le=MAX_CHECKSUM)

    @model_validator(mode="after")
    def check_layout(self) -> KVLayer:
        num_layers = self.layer_end - self.layer_start
        if num_layers < 1:
            raise ProtocolError(f"kv_layer: layer_end={self.layer_end} must be greater than layer_start={self.layer_start}")
        if len(self.shape) != 5 or self.shape[0] != num_layers or self.shape[1] not in (1, 2) \
                or self.shape[2] != self.num_tokens:
            raise ProtocolError(
                f"kv_layer.shape={list(self.shape)} must be [num_layers={num_layers}, planes (2 or 1), "
                f"num_tokens={self.num_tokens}, num_kv_heads, head_dim]")
        expected = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if self.nbytes != expected:
            raise ProtocolError(f"kv_layer.nbytes={self.nbytes} but shape {list(self.shape)} of {self.dtype} is {expected} bytes")
        return self

    def frame_sizes(self) -> tuple[int, ...]:
        return (self.nbytes,)

    def verify_frames(self, frames: Sequence[memoryview], *, verify_checksum: bool) -> None:
        super().verify_frames(frames, verify_checksum=verify_checksum)
        if verify_checksum and payload_checksum(frames[0]) != self.checksum:
            raise ChecksumMismatchError(
                f"kv_layer payload of request {self.request_id!r} (layers {self.layer_start}..{self.layer_end}) "
                f"fails its checksum: the bytes were corrupted in flight or by the sender; abort and retry the request",
                request_id=self.request_id)

    def tensor(self, frame: Any) -> Any:
        """Zero-copy view of the payload frame: [num_layers, planes, num_tokens, num_kv_heads, head_dim]."""
        return tensor_from_frame(frame, self.dtype, self.shape)

    @classmethod
    def from_tensor(cls, kv: Any, *, request_id: str, layer_start: int, token_start: int) -> tuple[KVLayer, memoryview]:
        """Header and payload for kv [num_layers, planes, num_tokens, num_kv_heads, head_dim] on the CPU."""
        if kv.dim() != 5 or kv.shape[1] not in (1, 2):
            raise ValueError(f"kv has shape {list(kv.shape)}: expected [num_layers, planes (2 or 1), num_tokens, "
                             "num_kv_heads, head_dim]")
        payload = as_buffer(kv)
        msg = cls(request_id=request_id, layer_start=layer_start, layer_end=layer_start + kv.shape[0],
                  token_start=token_start, num_tokens=kv.shape[2], dtype=dtype_name(kv.dtype),
                  shape=tuple(kv.shape), nbytes=payload.nbytes, checksum=payload_checksum(payload))
        return msg, payload


class KVDone(Message, type_name="kv_done"):
    """P -> D: every KVLayer of the request is sent. checksum = combine_checksums(KVLayer checksums
    in send order); first_logprobs ({token_id: logprob}) only when the request asked for logprobs."""

    request_id: str = Field(max_length=MAX_ID_LEN)
    first_token: TokenId
    num_tokens: int = Field(ge=1, le=MAX_TOKENS)
    checksum: int = Field(ge=0, le=MAX_CHECKSUM)
    first_logprobs: Annotated[dict[TokenId, float], max_items(MAX_LOGPROBS)] | None = None


class KVAck(Message, type_name="kv_ack"):
    """D -> P: the request's KV arrived intact (ok) or not (reason); P may free its blocks either way."""

    request_id: str = Field(max_length=MAX_ID_LEN)
    ok: bool
    reason: str = ""
