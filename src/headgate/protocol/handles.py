"""Data handles: small numbers that stand for data a peer deposited with the other.

A producer names a stream once, binds the name to a handle, and from then on
sends the handle instead of the name. Both peers must then agree on what each
number means, and when it stops meaning anything. This module keeps those
bindings for one handle type and one creator.

Numbers: handles of a type are consecutive numbers from zero; both peers
track the least number not yet assigned, and a bind takes it.

Resources: bind messages of a type travel on that type's own logical
channel, and there a guarantee means "will be bound", not only "will be
buffered". The table owned by the binding side's receiver holds that channel
(a :class:`~headgate.protocol.channel.ServerChannel`): it takes bind messages
out of the buffer without reissuing their space, keeps the bytes charged
while the binding lives, and grows the channel by as much once the binding is
deleted. So a bind costs its bytes from when it is sent until its binding is
gone, and a guaranteed bind always finds room to be bound.

A FreeHandle (:class:`~headgate.protocol.messages.FreeHandle`) is a control
message: it belongs to no channel. Freeing takes three steps, because a peer
may have sent a reference to a handle while the other was freeing it:

1. a peer proposes to free a handle (sends FreeHandle) and promises never to
   reference it again;
2. the other peer marks the binding for deletion and answers with its own
   FreeHandle;
3. the first peer, receiving that answer, marks the binding for deletion too.

Receiving a FreeHandle after having sent one is the confirmation, so two
peers freeing the same handle at once need nothing special. A binding marked
for deletion lives on while buffered messages reference it: "The peer locally
deletes a binding if it is marked for deletion while its counter is zero, or
if its counter reaches zero after it has been marked for deletion."

The state of one binding, as seen by one peer::

    LIVE ──free()──▶ FREED_BY_US ──on_free()──▶ MARKED ──count==0──▶ deleted
      └────────────────on_free() (answers)───────▲

Control frames about a handle's data channel (IssueGuarantees, Plead,
Absolve, ...) refer to the handle too, so the free governs them as well,
in one table, ``_PEER_FRAMES``, by the binding's state: the seed's proposer
"commits to not referring to that handle in any of its future messages",
and a peer that answers a proposal does so with a FreeHandle of its own.

* We send nothing about a binding that is not LIVE (:meth:`HandleTable.may_refer`):
  our FreeHandle is out. So a Plead that crosses our FreeHandle gets no Absolve.
* A peer's frame about a binding FREED_BY_US crossed our FreeHandle (the peer
  sent it before it saw ours): it is ignored, and not answered.
* A peer's frame about a binding it freed itself (MARKED, or deleted) breaks
  its promise: ``HANDLE_FREED``, as for a data message.

Who may propose is a table's :class:`FreeRule`. The seed lets either peer
propose (``EITHER``). A headgate session uses ``CREATOR``: only the peer
that bound a handle proposes to free it, and the other peer's FreeHandle is
only ever the answer. So a reader cannot free a handle the gateway bound for
its fetches (and the gateway then go on using a handle the peer took away):
a peer's proposal to free a handle we created is refused with
``UNEXPECTED_FRAME``, while its confirmation of our own proposal stands.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from headgate.protocol.channel import ServerChannel
from headgate.protocol.errors import ErrorCode, HandleError
from headgate.protocol.messages import FreeHandle, HandleType

V = TypeVar("V")

__all__ = [
    "BindingState",
    "FrameUse",
    "FreeRule",
    "Freed",
    "HandleSpace",
    "HandleTable",
    "HandleTableStatistics",
    "Referenced",
    "Released",
    "UnboundReference",
]


# --- messages and outcomes ---------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Referenced(Generic[V]):
    """A message that references the handle may be buffered; it is counted."""

    #: The handle.
    handle: int
    #: The value bound to it.
    value: V


@dataclass(frozen=True, slots=True, kw_only=True)
class UnboundReference:
    """An optimistic reference to a handle whose bind message was dropped.

    The bind channel already announced the drop, so the client knows that
    this reference was not processed either. Drop the referencing message
    without processing it; nothing was counted.
    """

    #: The handle that is still unbound.
    handle: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Released:
    """A buffered message that referenced the handle has been processed."""

    #: The handle.
    handle: int
    #: Whether that was the last reference to a binding marked for deletion,
    #: so the binding is now gone.
    deleted: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Freed:
    """The outcome of receiving a FreeHandle."""

    #: The handle.
    handle: int
    #: Our own FreeHandle to send back, or None if this was the confirmation
    #: of a proposal we sent.
    reply: FreeHandle | None
    #: Whether the binding was deleted at once (no buffered references).
    deleted: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class HandleTableStatistics:
    """A snapshot of a handle table, for metrics."""

    #: Bindings that exist, in any state.
    bindings: int
    #: Bindings we proposed to free, awaiting the peer's confirmation.
    freed_by_us: int
    #: Bindings marked for deletion that buffered messages still reference.
    marked_for_deletion: int
    #: Buffered messages' references, summed over all bindings.
    references: int
    #: Bytes of bind messages held by live bindings.
    bound_bytes: int


class BindingState(Enum):
    """Where one binding is in the three-step free, from one peer's side."""

    #: Both peers may reference it.
    LIVE = "live"
    #: We proposed to free it and no longer reference it; the peer still may.
    FREED_BY_US = "freed_by_us"
    #: Both peers freed it; it is deleted once no buffered message references it.
    MARKED = "marked"


class FrameUse(Enum):
    """What to do with a peer's control frame about a handle's data channel."""

    #: The binding is live: apply the frame (and answer it, if it asks).
    APPLY = "apply"
    #: It crossed our FreeHandle: neither apply nor answer it (we promised
    #: never to refer to the handle again, and the channel is going away).
    IGNORE = "ignore"


class FreeRule(Enum):
    """Which peer may propose to free a handle (the other one answers)."""

    #: Either peer, as the seed allows ("they should both be able to remove
    #: bindings").
    EITHER = "either"
    #: Only the peer that created the handle (headgate's sessions).
    CREATOR = "creator"


class _Proposers(Enum):
    # Who may propose, for one table: its rule seen from its side.
    BOTH = "both"
    US = "us"
    PEER = "peer"


class _FreeEvent(Enum):
    WE_PROPOSE = "we_propose"
    PEER_PROPOSES = "peer_proposes"


_LIVE, _FREED_BY_US, _MARKED = BindingState.LIVE, BindingState.FREED_BY_US, BindingState.MARKED

# The whole free protocol: (who may propose, state, event) -> the next state,
# or the code that refuses the peer's FreeHandle. A key that is missing is
# an error too: ours if we propose (ValueError), the peer's if it proposes
# (HandleError HANDLE_FREED: it freed the handle already).
_FREE_TRANSITIONS: dict[tuple[_Proposers, BindingState, _FreeEvent], BindingState | ErrorCode] = {
    # Either peer proposes.
    (_Proposers.BOTH, _LIVE, _FreeEvent.WE_PROPOSE): _FREED_BY_US,
    # "the other peer, upon receiving that proposal, marks the corresponding
    # handle-to-value binding in its local mapping for deletion"
    (_Proposers.BOTH, _LIVE, _FreeEvent.PEER_PROPOSES): _MARKED,
    # "Receiving a proposal to free a resource handle after having sent such a
    # proposal oneself confirms that the binding can be removed"
    (_Proposers.BOTH, _FREED_BY_US, _FreeEvent.PEER_PROPOSES): _MARKED,
    # We created the handles and alone propose; the peer's FreeHandle can
    # only confirm our proposal. Proposing itself is not its to do.
    (_Proposers.US, _LIVE, _FreeEvent.WE_PROPOSE): _FREED_BY_US,
    (_Proposers.US, _LIVE, _FreeEvent.PEER_PROPOSES): ErrorCode.UNEXPECTED_FRAME,
    (_Proposers.US, _FREED_BY_US, _FreeEvent.PEER_PROPOSES): _MARKED,
    # The peer created them and alone proposes; we answer.
    (_Proposers.PEER, _LIVE, _FreeEvent.PEER_PROPOSES): _MARKED,
}


# A peer's control frame about a handle's channel, by the binding's state on
# our side (None: deleted), -> what to do, or the code that refuses it. The
# same for the handles of both creators: who created the handle decides who
# sends on its channel, not who promised what.
_PEER_FRAMES: dict[BindingState | None, FrameUse | ErrorCode] = {
    _LIVE: FrameUse.APPLY,
    # We proposed; the peer sent this before our FreeHandle reached it.
    _FREED_BY_US: FrameUse.IGNORE,
    # The peer sent its own FreeHandle before this frame (a proposal or the
    # confirmation of ours: the stream is in order), and so promised not to.
    _MARKED: ErrorCode.HANDLE_FREED,
    None: ErrorCode.HANDLE_FREED,
}


@dataclass(slots=True)
class _Binding(Generic[V]):
    value: V
    size: int
    state: BindingState = BindingState.LIVE
    references: int = 0
    # For handles we created: whether the bind is certain to be (or have
    # been) bound by the peer, i.e. was not sent optimistically.
    confirmed: bool = True
    # What :meth:`HandleTable.on_reference` answers for this binding (it is
    # immutable): made once at the bind, not once per message.
    reference: Referenced[V] | None = None


# --- one table ---------------------------------------------------------------


class HandleTable(Generic[V]):
    """The bindings of one handle type that one of the two peers created.

    A session keeps, per handle type, one table for the handles it created
    (``created_by_us=True``: it binds when it sends the bind message) and one
    for the handles the peer created (``created_by_us=False``: it binds when
    it processes a bind message from the bind channel's buffer).

    Args:
        handle_type: the handle type, copied into FreeHandle messages.
        created_by_us: which peer creates the handles of this table.
        bind_channel: for a table of the peer's handles, the server end of
            the channel that carries the peer's bind messages (its messages
            are the values to bind). Optional: without it, call :meth:`bind`
            directly, and optimistic references cannot be resolved.
        free_rule: which peer may propose to free a handle (the seed's
            ``EITHER`` by default).
    """

    def __init__(
        self,
        handle_type: HandleType,
        *,
        created_by_us: bool,
        bind_channel: ServerChannel[V] | None = None,
        free_rule: FreeRule = FreeRule.EITHER,
    ) -> None:
        if created_by_us and bind_channel is not None:
            raise ValueError("only the table of the peer's handles reads a bind channel")
        self._handle_type = handle_type
        self._created_by_us = created_by_us
        if free_rule is FreeRule.EITHER:
            self._proposers = _Proposers.BOTH
        else:
            self._proposers = _Proposers.US if created_by_us else _Proposers.PEER
        self._bind_channel = bind_channel
        self._bindings: dict[int, _Binding[V]] = {}
        self._next_handle = 0

    # -- read-only view --

    @property
    def handle_type(self) -> HandleType:
        return self._handle_type

    @property
    def created_by_us(self) -> bool:
        return self._created_by_us

    @property
    def next_handle(self) -> int:
        """The least handle not assigned yet."""
        return self._next_handle

    def __contains__(self, handle: object) -> bool:
        return handle in self._bindings

    def __len__(self) -> int:
        return len(self._bindings)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._bindings))

    def state(self, handle: int) -> BindingState | None:
        """The binding's state, or None if it was never bound or is deleted."""
        binding = self._bindings.get(handle)
        return None if binding is None else binding.state

    def references(self, handle: int) -> int:
        """How many buffered messages reference the handle (0 if deleted)."""
        binding = self._bindings.get(handle)
        return 0 if binding is None else binding.references

    def is_confirmed(self, handle: int) -> bool:
        binding = self._bindings.get(handle)
        return binding is not None and binding.confirmed

    def statistics(self) -> HandleTableStatistics:
        bindings = self._bindings.values()
        return HandleTableStatistics(
            bindings=len(self._bindings),
            freed_by_us=sum(b.state is BindingState.FREED_BY_US for b in bindings),
            marked_for_deletion=sum(b.state is BindingState.MARKED for b in bindings),
            references=sum(b.references for b in bindings),
            bound_bytes=sum(b.size for b in bindings),
        )

    # -- binding --

    def bind(self, value: V, *, size: int = 0, confirmed: bool = True) -> int:
        """Bind ``value`` to the least unassigned handle and return the handle.

        For our own handles, call this when sending the bind message, with
        ``confirmed=False`` if it went out optimistically (then
        :meth:`confirm` it once the bind channel says it was buffered).
        ``size`` is the bytes the binding keeps charged to the bind channel.
        """
        if size < 0:
            raise ValueError(f"size must not be negative, got {size}")
        handle = self._next_handle
        self._next_handle += 1
        self._bindings[handle] = _Binding(
            value=value,
            size=size,
            confirmed=confirmed,
            reference=Referenced(handle=handle, value=value),
        )
        return handle

    def confirm(self, handle: int) -> None:
        """Our bind message for ``handle`` is certain to be bound by the peer.

        A handle that is gone already is fine: the peer may bind an optimistic
        bind and free the handle before the guarantees confirming it arrive.
        """
        binding = self._bindings.get(handle)
        if binding is not None:
            binding.confirmed = True
        elif handle >= self._next_handle:
            raise ValueError(f"handle {handle} is not bound")

    def bind_pending(self) -> list[int]:
        """Bind every bind message buffered on the bind channel, oldest first."""
        channel = self._bind_channel
        if channel is None:
            return []
        bound: list[int] = []
        while channel.buffered_messages:
            # No reissue: "guarantees ... must guarantee not only that the
            # messages will be buffered, but that they will be processed and the
            # resource handles will be bound", so the bytes stay charged until
            # the binding is deleted.
            value, size = channel.process(reissue=False)
            bound.append(self.bind(value, size=size))
        return bound

    def _resolve(self, handle: int) -> bool:
        """Bind pending messages if ``handle`` lies beyond the bound ones."""
        if handle >= self._next_handle:
            # "it must first check whether it has unprocessed messages for
            # binding resource handles of this type, and process as many of
            # them as possible"
            self.bind_pending()
        return handle < self._next_handle

    def _bind_was_dropped_for(self, handle: int) -> bool:
        """Whether ``handle`` is the peer's, still unbound, and its bind was dropped."""
        if self._created_by_us or self._resolve(handle):
            return False
        # "If, however, it then still has not bound the resource handle in
        # question, then the message for binding the resource handle must have
        # been dropped". A drop leaves the channel dropping until the apology,
        # which the client sends only after learning of the drop, so anything
        # it sent before then arrives while the channel is still dropping.
        # Otherwise the handle was simply never bound: UNKNOWN_HANDLE.
        return self._bind_channel is not None and self._bind_channel.dropping

    # -- references from our own messages --

    def may_refer(self, handle: int) -> bool:
        """Whether we may send a frame about ``handle`` (its binding is LIVE).

        Once our FreeHandle for it is out (as proposal or as answer), we never
        refer to it again: not in a data message (:meth:`use`), and not in a
        control frame about its channel either.
        """
        return self.state(handle) is BindingState.LIVE

    def use(self, handle: int) -> V:
        """Check that we may reference ``handle`` in a message we send.

        Raises:
            ValueError: the handle is unknown, or we proposed to free it and
                so promised never to reference it again.
        """
        if not self._created_by_us:
            self._resolve(handle)
        binding = self._bindings.get(handle)
        if binding is None:
            if handle < self._next_handle:
                raise ValueError(f"handle {handle} was freed")
            raise ValueError(f"handle {handle} is not bound")
        if binding.state is not BindingState.LIVE:
            raise ValueError(f"handle {handle} was freed; it must not be referenced")
        return binding.value

    # -- references from the peer's messages --

    def on_channel_frame(self, handle: int) -> FrameUse | None:
        """What to do with a peer's control frame about ``handle``'s data channel.

        Returns None for a handle that was never bound (the caller refuses
        the frame as it sees fit; bind what waits in the bind channel first);
        otherwise the verdict of ``_PEER_FRAMES``.

        Raises:
            HandleError: HANDLE_FREED if the peer had freed the handle.
        """
        if handle >= self._next_handle:
            return None
        binding = self._bindings.get(handle)
        verdict = _PEER_FRAMES[None if binding is None else binding.state]
        if isinstance(verdict, ErrorCode):
            raise HandleError(
                f"handle {handle} of type {self._handle_type}: a frame about its channel "
                "after the peer freed it",
                code=verdict,
            )
        return verdict

    def on_reference(self, handle: int) -> Referenced[V] | UnboundReference:
        """A peer's message referencing ``handle`` is about to be buffered.

        Counts the reference until :meth:`release`. A handle beyond the bound
        ones first makes pending bind messages bound; if it is still unbound,
        its bind was dropped and so is this message.

        Raises:
            HandleError: UNKNOWN_HANDLE if the handle was never bound;
                HANDLE_FREED if the peer proposed or confirmed freeing it.
        """
        if self._bind_was_dropped_for(handle):
            return UnboundReference(handle=handle)
        binding = self._binding_for_peer(handle)
        if binding.state is BindingState.MARKED:
            # Marked means the peer sent its FreeHandle: it promised never to
            # reference the handle again, in any later message.
            raise HandleError(
                f"handle {handle} of type {self._handle_type} referenced after it was freed",
                code=ErrorCode.HANDLE_FREED,
            )
        binding.references += 1
        reference = binding.reference
        if reference is None:
            reference = binding.reference = Referenced(handle=handle, value=binding.value)
        return reference

    def dereference(self, handle: int) -> V:
        """The value of a handle that a buffered message references.

        A counted reference keeps the binding alive, so this cannot fail for
        a message that :meth:`on_reference` accepted and that is not released.
        """
        binding = self._bindings.get(handle)
        if binding is None:
            raise RuntimeError(f"handle {handle} is not bound (was the message released?)")
        return binding.value

    def release(self, handle: int, count: int = 1) -> Released:
        """``count`` buffered messages referencing ``handle`` have been fully processed."""
        binding = self._bindings.get(handle)
        if binding is None or binding.references < count or count < 1:
            raise RuntimeError(f"handle {handle} has no {count} counted references to release")
        binding.references -= count
        return Released(handle=handle, deleted=self._delete_if_done(handle, binding))

    # -- freeing --

    def free(self, handle: int) -> FreeHandle:
        """Propose to free ``handle``; from now on we never reference it.

        Raises:
            ValueError: the handle is unknown or already freed, or it is ours
                and its bind is still optimistic (a FreeHandle could then
                overtake a bind that gets dropped and sent again), or the
                table's rule leaves proposing to the peer.
        """
        binding = self._bindings.get(handle)
        if binding is None:
            raise ValueError(f"handle {handle} is not bound")
        if not binding.confirmed:
            raise ValueError(f"handle {handle}: its bind is not confirmed yet")
        next_state = _FREE_TRANSITIONS.get((self._proposers, binding.state, _FreeEvent.WE_PROPOSE))
        if not isinstance(next_state, BindingState):
            if self._proposers is _Proposers.PEER:
                raise ValueError(f"handle {handle} is the peer's: only the peer frees it")
            raise ValueError(f"handle {handle} was already freed")
        binding.state = next_state
        return FreeHandle(handle_type=self._handle_type, handle=handle, mine=self._created_by_us)

    def on_free(self, handle: int) -> Freed | UnboundReference:
        """The peer proposed (or confirmed) freeing ``handle``.

        Raises:
            HandleError: UNKNOWN_HANDLE if it was never bound; HANDLE_FREED
                if the peer had freed it already; UNEXPECTED_FRAME if we
                created it, alone may propose its free, and did not.
        """
        if self._bind_was_dropped_for(handle):
            return UnboundReference(handle=handle)
        binding = self._binding_for_peer(handle)
        next_state = _FREE_TRANSITIONS.get(
            (self._proposers, binding.state, _FreeEvent.PEER_PROPOSES)
        )
        if next_state is None:
            raise HandleError(
                f"handle {handle} of type {self._handle_type} freed twice",
                code=ErrorCode.HANDLE_FREED,
            )
        if isinstance(next_state, ErrorCode):
            raise HandleError(
                f"handle {handle} of type {self._handle_type} was bound by this end: "
                "only this end proposes to free it",
                code=next_state,
            )
        reply = None
        if binding.state is BindingState.LIVE:
            reply = FreeHandle(
                handle_type=self._handle_type, handle=handle, mine=self._created_by_us
            )
        binding.state = next_state
        return Freed(handle=handle, reply=reply, deleted=self._delete_if_done(handle, binding))

    # -- helpers --

    def _binding_for_peer(self, handle: int) -> _Binding[V]:
        binding = self._bindings.get(handle)
        if binding is not None:
            return binding
        if 0 <= handle < self._next_handle:
            # Bound once and deleted: deletion needs the peer's FreeHandle,
            # so the peer promised never to use it again.
            raise HandleError(
                f"handle {handle} of type {self._handle_type} was freed",
                code=ErrorCode.HANDLE_FREED,
            )
        raise HandleError(
            f"handle {handle} of type {self._handle_type} is not bound",
            code=ErrorCode.UNKNOWN_HANDLE,
        )

    def _delete_if_done(self, handle: int, binding: _Binding[V]) -> bool:
        if binding.state is not BindingState.MARKED or binding.references > 0:
            return False
        del self._bindings[handle]
        if self._bind_channel is not None and binding.size:
            # The bytes the bind message kept charged become buffer space again.
            self._bind_channel.grow(binding.size)
        return True


# --- both tables of one handle type -----------------------------------------


class HandleSpace(Generic[V]):
    """Both tables of one handle type, for peers that each create handles.

    A FreeHandle names the handle by number and by creator (``mine`` is from
    the sender's side), so a received one goes to the table of the handles
    its sender did or did not create.

    Args:
        handle_type: the handle type.
        bind_channel: the server end of the channel carrying the peer's binds.
        free_rule: which peer may propose to free a handle, in both tables.
    """

    def __init__(
        self,
        handle_type: HandleType,
        *,
        bind_channel: ServerChannel[V] | None = None,
        free_rule: FreeRule = FreeRule.EITHER,
    ) -> None:
        self.ours: HandleTable[V] = HandleTable(
            handle_type, created_by_us=True, free_rule=free_rule
        )
        self.theirs: HandleTable[V] = HandleTable(
            handle_type, created_by_us=False, bind_channel=bind_channel, free_rule=free_rule
        )

    @property
    def handle_type(self) -> HandleType:
        return self.ours.handle_type

    def table(self, *, created_by_us: bool) -> HandleTable[V]:
        return self.ours if created_by_us else self.theirs

    def on_free_handle(self, message: FreeHandle) -> Freed | UnboundReference:
        """Route a received FreeHandle to the table it means."""
        if message.handle_type != self.handle_type:
            raise ValueError(
                f"FreeHandle for type {message.handle_type} given to type {self.handle_type}"
            )
        # The sender created the handle exactly when we did not.
        return self.table(created_by_us=not message.mine).on_free(message.handle)
