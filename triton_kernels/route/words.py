"""The device route's words: where the header, reply and status fields sit in device memory, and
what each status code means (the holder kernel, the requester's put and merge kernels and
``mqnc.transport.device_route`` read them from here; ``docs/device-route.md`` draws the table).

Every word is an int64. An inbox slot's header is ``HEADER_WORDS`` words, a reply slot's
``REPLY_WORDS``; signal words are separate ``[slots]`` int64 arrays (NVSHMEM's signal words are
64-bit), raised to the request's sequence number with release semantics after the payload.
"""

from __future__ import annotations

import triton.language as tl

# ---- the inbox header: [slots, HEADER_WORDS] int64 --------------------------------------------
HEADER_WORDS = 8
H_SEQ = tl.constexpr(0)  # sequence number, equal to the slot's signal (>= 1, increasing);
# the slot's last number (the sender's copy): a put takes it + 1, whichever client it is
H_LAYER = tl.constexpr(1)  # which layer's cache
H_CHUNK = tl.constexpr(2)  # the holder's chunk id (an index of its chunk table)
H_BATCH = tl.constexpr(3)  # query tokens B (rows = B * heads)
H_HEADS = tl.constexpr(4)  # heads per token
H_MODE = tl.constexpr(5)  # MODE_DENSE, MODE_SPARSE or MODE_PROBE
H_TOPK = tl.constexpr(6)  # selection width (sparse)

# ---- the reply header: [slots, REPLY_WORDS] int64 ---------------------------------------------
REPLY_WORDS = 5
R_SEQ = tl.constexpr(0)  # the sequence number answered (= the reply signal)
R_STATUS = tl.constexpr(1)  # OK or an error code below
R_DETAIL = tl.constexpr(2)  # the offending value of an error (0 when OK)
R_ROWS = tl.constexpr(3)  # rows answered (B * heads; 0 for an error or a probe)
R_HEADS = tl.constexpr(4)  # heads answered per token (0 for an error or a probe)

# ---- modes --------------------------------------------------------------------------------------
MODE_DENSE = tl.constexpr(0)
MODE_SPARSE = tl.constexpr(1)
MODE_PROBE = tl.constexpr(2)

# ---- status codes (reply word R_STATUS; the requester's merge adds TIMEOUT) -------------------
OK = tl.constexpr(0)
ERR_SEQ = tl.constexpr(1)  # the header's number is not the signal, or the signal went backwards
# (requester side: a reply header that does not echo the awaited number)
ERR_MODE = tl.constexpr(2)  # a mode the holder does not serve
ERR_LAYER = tl.constexpr(3)  # a layer outside [0, layers)
ERR_CHUNK = tl.constexpr(4)  # a chunk id outside the table, or not hosted
ERR_ROWS = tl.constexpr(5)  # B < 1, heads outside [1, H], B above the slot, or rows above max
ERR_TOPK = tl.constexpr(6)  # a selection width outside [1, max_topk]
ERR_INDEX = tl.constexpr(7)  # a selected index outside [-1, c_t) (never read)
TIMEOUT = tl.constexpr(8)  # (requester side) no reply within the merge's bounded wait
UNANSWERED = tl.constexpr(9)  # (requester side) the merge reads rows the reply did not answer

STATUS_NAMES = {
    0: "ok",
    1: "sequence",
    2: "mode",
    3: "layer",
    4: "chunk",
    5: "rows",
    6: "topk",
    7: "index",
    8: "timeout",
    9: "unanswered",
}


# ---- the buffers, as the kernels take them -------------------------------------------------------
import dataclasses  # noqa: E402

import torch  # noqa: E402


@dataclasses.dataclass(frozen=True)
class RouteBuffers:
    """The inbox and reply slots of a device route, ``slots`` of them (one per requester lane),
    contiguous, on one device (the ``local`` backend) or in NVSHMEM's symmetric heap (every PE
    has its own copy at the same address: the requester's put and the holder's reply go from
    the sender's copy to the receiver's).

    Attributes
    ----------
    in_sig : ``[slots]`` int64, the inbox signal words (the request's sequence number).
    in_hdr : ``[slots, HEADER_WORDS]`` int64, the request headers.
    in_q : ``[slots, max_batch, H, d_qk]`` in the cache dtype, the absorbed query rows.
    in_idx : ``[slots, max_batch, max_topk]`` int32, chunk-local selections (-1 unused).
    rep_sig : ``[slots]`` int64, the reply signal words (the answered sequence number).
    rep_hdr : ``[slots, REPLY_WORDS]`` int64, the reply headers (sequence, status, detail, rows,
        heads).
    rep_o : ``[slots, max_batch, H, d_v]`` in the cache dtype, the partial's ``o``.
    rep_lse : ``[slots, max_batch, H]`` float32, the partial's natural-log ``lse``.
    """

    in_sig: torch.Tensor
    in_hdr: torch.Tensor
    in_q: torch.Tensor
    in_idx: torch.Tensor
    rep_sig: torch.Tensor
    rep_hdr: torch.Tensor
    rep_o: torch.Tensor
    rep_lse: torch.Tensor

    @property
    def slots(self) -> int:
        return self.in_sig.shape[0]

    @property
    def max_batch(self) -> int:
        return self.in_q.shape[1]

    @property
    def heads(self) -> int:
        return self.in_q.shape[2]

    @property
    def max_topk(self) -> int:
        return self.in_idx.shape[2]
