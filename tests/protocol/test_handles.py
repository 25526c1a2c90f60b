"""Data handles: one test per rule of the seed's "Data Handles" section, and per error."""

from __future__ import annotations

import pytest

from headgate.protocol.channel import ClientChannel, MessageDropped, ServerChannel
from headgate.protocol.errors import ErrorCode, HandleError
from headgate.protocol.handles import (
    BindingState,
    Freed,
    FreeRule,
    HandleSpace,
    HandleTable,
    HandleTableStatistics,
    Referenced,
    Released,
    UnboundReference,
)
from headgate.protocol.messages import FreeHandle, HandleType

STREAM = HandleType.STREAM


def pair() -> tuple[HandleTable[str], HandleTable[str]]:
    """The creator's table and the other peer's table of the same handles."""
    return (
        HandleTable(STREAM, created_by_us=True),
        HandleTable(STREAM, created_by_us=False),
    )


def bind_both(creator: HandleTable[str], other: HandleTable[str], value: str) -> int:
    handle = creator.bind(value)
    assert other.bind(value) == handle
    return handle


# --- numbers -------------------------------------------------------------------


def test_handles_are_consecutive_numbers_from_zero_on_both_peers() -> None:
    creator, other = pair()
    assert creator.next_handle == other.next_handle == 0
    assert [bind_both(creator, other, name) for name in ("a", "b", "c")] == [0, 1, 2]
    assert creator.next_handle == other.next_handle == 3
    assert other.dereference(1) == creator.dereference(1) == "b"
    assert list(other) == [0, 1, 2] and len(other) == 3 and 2 in other


def test_numbers_are_never_reused_after_a_free() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    other.on_free(handle)
    creator.on_free(handle)  # the answer
    assert handle not in creator and handle not in other
    assert bind_both(creator, other, "b") == 1


# --- the three-step free --------------------------------------------------------


def test_three_step_free_proposal_answer_confirmation() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")

    # 1. The creator proposes and promises never to reference the handle again.
    proposal = creator.free(handle)
    assert proposal == FreeHandle(handle_type=STREAM, handle=handle, mine=True)
    assert creator.state(handle) is BindingState.FREED_BY_US
    with pytest.raises(ValueError, match="freed"):
        creator.use(handle)

    # 2. The other peer marks the binding for deletion and answers.
    answered = other.on_free(proposal.handle)
    assert answered == Freed(
        handle=handle,
        reply=FreeHandle(handle_type=STREAM, handle=handle, mine=False),
        deleted=True,
    )
    assert handle not in other

    # 3. The answer confirms: the creator marks (and here deletes) it too.
    assert creator.on_free(handle) == Freed(handle=handle, reply=None, deleted=True)
    assert handle not in creator


def test_either_peer_may_propose_the_free() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    proposal = other.free(handle)
    assert proposal.mine is False
    answered = creator.on_free(handle)
    assert isinstance(answered, Freed)
    assert answered.reply == FreeHandle(handle_type=STREAM, handle=handle, mine=True)
    assert other.on_free(handle) == Freed(handle=handle, reply=None, deleted=True)


def test_concurrent_proposals_confirm_each_other() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    creator.free(handle)
    other.free(handle)
    # Each proposal crosses the other on the wire; neither needs an answer.
    assert creator.on_free(handle) == Freed(handle=handle, reply=None, deleted=True)
    assert other.on_free(handle) == Freed(handle=handle, reply=None, deleted=True)


def test_the_proposer_still_accepts_references_sent_before_the_answer() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    creator.free(handle)
    # The other peer referenced the handle before it saw the proposal.
    assert creator.on_reference(handle) == Referenced(handle=handle, value="a")


# --- reference counts -----------------------------------------------------------


def test_a_marked_binding_lives_while_buffered_messages_reference_it() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    other.on_reference(handle)
    other.on_reference(handle)
    assert other.references(handle) == 2

    answered = other.on_free(creator.free(handle).handle)
    assert isinstance(answered, Freed)
    assert answered.deleted is False
    assert other.state(handle) is BindingState.MARKED
    assert other.dereference(handle) == "a"

    assert other.release(handle) == Released(handle=handle, deleted=False)
    assert other.dereference(handle) == "a"
    assert other.release(handle) == Released(handle=handle, deleted=True)
    assert handle not in other


def test_releasing_a_live_binding_does_not_delete_it() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    other.on_reference(handle)
    assert other.release(handle) == Released(handle=handle, deleted=False)
    assert other.state(handle) is BindingState.LIVE


def test_release_without_a_counted_reference_is_a_local_error() -> None:
    _, other = pair()
    other.bind("a")
    with pytest.raises(RuntimeError):
        other.release(0)
    with pytest.raises(RuntimeError):
        other.release(5)


def test_dereferencing_a_deleted_binding_is_a_local_error() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    other.on_free(handle)
    with pytest.raises(RuntimeError):
        other.dereference(handle)


# --- errors ---------------------------------------------------------------------


def test_referencing_an_unknown_handle_is_unknown_handle() -> None:
    creator, other = pair()
    bind_both(creator, other, "a")
    with pytest.raises(HandleError) as caught:
        other.on_reference(1)
    assert caught.value.code is ErrorCode.UNKNOWN_HANDLE
    with pytest.raises(HandleError) as caught:
        creator.on_reference(7)
    assert caught.value.code is ErrorCode.UNKNOWN_HANDLE


def test_the_peer_referencing_a_handle_it_freed_is_handle_freed() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    other.on_reference(handle)  # keeps the marked binding alive
    other.on_free(handle)
    with pytest.raises(HandleError) as caught:
        other.on_reference(handle)
    assert caught.value.code is ErrorCode.HANDLE_FREED


def test_the_peer_referencing_a_deleted_handle_is_handle_freed() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    other.on_free(handle)
    with pytest.raises(HandleError) as caught:
        other.on_reference(handle)
    assert caught.value.code is ErrorCode.HANDLE_FREED


def test_the_peer_freeing_twice_is_handle_freed() -> None:
    creator, other = pair()
    handle = bind_both(creator, other, "a")
    other.on_reference(handle)
    other.on_free(handle)
    with pytest.raises(HandleError) as caught:
        other.on_free(handle)
    assert caught.value.code is ErrorCode.HANDLE_FREED
    other.release(handle)
    with pytest.raises(HandleError) as caught:
        other.on_free(handle)
    assert caught.value.code is ErrorCode.HANDLE_FREED


def test_the_peer_freeing_an_unknown_handle_is_unknown_handle() -> None:
    creator, other = pair()
    with pytest.raises(HandleError) as caught:
        other.on_free(0)
    assert caught.value.code is ErrorCode.UNKNOWN_HANDLE
    with pytest.raises(HandleError) as caught:
        creator.on_free(3)
    assert caught.value.code is ErrorCode.UNKNOWN_HANDLE


def test_freeing_twice_or_freeing_unknown_locally_is_a_value_error() -> None:
    creator, _ = pair()
    handle = creator.bind("a")
    creator.free(handle)
    with pytest.raises(ValueError, match="already freed"):
        creator.free(handle)
    with pytest.raises(ValueError, match="not bound"):
        creator.free(9)


def test_using_a_handle_we_freed_or_never_bound_is_a_value_error() -> None:
    creator, _ = pair()
    handle = creator.bind("a")
    assert creator.use(handle) == "a"
    with pytest.raises(ValueError, match="not bound"):
        creator.use(1)
    creator.free(handle)
    creator.on_free(handle)
    with pytest.raises(ValueError, match="freed"):
        creator.use(handle)


def test_negative_bind_size_is_a_value_error() -> None:
    creator, _ = pair()
    with pytest.raises(ValueError):
        creator.bind("a", size=-1)


# --- resource control: the bind channel --------------------------------------------


def bind_channel(capacity: int) -> tuple[ServerChannel[str], ClientChannel[str]]:
    server: ServerChannel[str] = ServerChannel(0)
    client: ClientChannel[str] = ClientChannel(0)
    server.grow(capacity)
    frame = server.issue()
    if frame is not None:
        client.on_issue_guarantees(frame.amount)
    return server, client


def test_bound_bytes_stay_charged_until_the_binding_is_deleted() -> None:
    # "guarantees ... must guarantee not only that the messages will be
    # buffered, but that they will be processed and the resource handles
    # will be bound"
    server, client = bind_channel(10)
    table: HandleTable[str] = HandleTable(STREAM, created_by_us=False, bind_channel=server)
    client.send("name", 4)
    server.receive("name", 4)
    assert table.bind_pending() == [0]
    assert server.capacity == 6 and server.issuable == 0 and server.free == 6
    assert table.statistics().bound_bytes == 4

    table.on_free(0)
    assert server.capacity == 10 and server.issuable == 4
    assert server.issue() is not None


def test_an_optimistic_reference_first_binds_pending_bind_messages() -> None:
    server, client = bind_channel(10)
    table: HandleTable[str] = HandleTable(STREAM, created_by_us=False, bind_channel=server)
    for name in ("a", "b", "c"):
        client.send(name, 2)
        server.receive(name, 2)
    assert table.next_handle == 0

    # Handle 1 is greater than any bound one: bind as many as possible.
    assert table.on_reference(1) == Referenced(handle=1, value="b")
    assert table.next_handle == 3
    assert server.buffered_messages == 0
    assert table.references(1) == 1


def test_an_optimistic_reference_to_a_dropped_bind_is_dropped_silently() -> None:
    server, client = bind_channel(2)
    table: HandleTable[str] = HandleTable(STREAM, created_by_us=False, bind_channel=server)
    client.send("a", 2)
    server.receive("a", 2)
    client.send("bb", 3, optimistic=True)
    assert isinstance(server.receive("bb", 3), MessageDropped)
    assert server.dropping

    assert table.on_reference(0) == Referenced(handle=0, value="a")
    assert table.on_reference(1) == UnboundReference(handle=1)
    assert table.references(0) == 1 and 1 not in table
    stats = table.statistics()
    assert stats.references == 1


def test_an_unbound_reference_without_a_dropped_bind_is_unknown_handle() -> None:
    server, _ = bind_channel(4)
    table: HandleTable[str] = HandleTable(STREAM, created_by_us=False, bind_channel=server)
    with pytest.raises(HandleError) as caught:
        table.on_reference(0)
    assert caught.value.code is ErrorCode.UNKNOWN_HANDLE


def test_a_free_overtaking_its_guaranteed_bind_binds_it_first() -> None:
    # FreeHandle is a control message and is handled at once, while the bind
    # may still wait in the bind channel's buffer.
    server, client = bind_channel(4)
    table: HandleTable[str] = HandleTable(STREAM, created_by_us=False, bind_channel=server)
    client.send("a", 2)
    server.receive("a", 2)
    answered = table.on_free(0)
    assert isinstance(answered, Freed)
    assert answered.reply == FreeHandle(handle_type=STREAM, handle=0, mine=False)
    assert answered.deleted
    assert server.capacity == 4


def test_a_free_of_a_dropped_bind_is_dropped_silently() -> None:
    server, client = bind_channel(0)
    table: HandleTable[str] = HandleTable(STREAM, created_by_us=False, bind_channel=server)
    client.send("a", 2, optimistic=True)
    server.receive("a", 2)
    assert table.on_free(0) == UnboundReference(handle=0)


def test_we_may_use_a_peer_handle_whose_bind_is_still_buffered() -> None:
    server, client = bind_channel(4)
    table: HandleTable[str] = HandleTable(STREAM, created_by_us=False, bind_channel=server)
    client.send("a", 2)
    server.receive("a", 2)
    assert table.use(0) == "a"


def test_an_optimistic_own_bind_can_be_freed_only_once_confirmed() -> None:
    creator: HandleTable[str] = HandleTable(STREAM, created_by_us=True)
    handle = creator.bind("a", confirmed=False)
    assert creator.use(handle) == "a"  # optimistic references are allowed
    with pytest.raises(ValueError, match="not confirmed"):
        creator.free(handle)
    creator.confirm(handle)
    assert creator.is_confirmed(handle)
    assert creator.free(handle).handle == handle


def test_only_the_table_of_peer_handles_reads_a_bind_channel() -> None:
    server, _ = bind_channel(0)
    with pytest.raises(ValueError):
        HandleTable(STREAM, created_by_us=True, bind_channel=server)


# --- symmetric peers -------------------------------------------------------------


def test_free_handle_goes_to_the_table_its_mine_flag_names() -> None:
    # Both peers create handle 0 of the same type; `mine` tells them apart.
    alice: HandleSpace[str] = HandleSpace(STREAM)
    bob: HandleSpace[str] = HandleSpace(STREAM)
    assert alice.ours.bind("alice's") == 0
    assert bob.theirs.bind("alice's") == 0
    assert bob.ours.bind("bob's") == 0
    assert alice.theirs.bind("bob's") == 0

    proposal = alice.ours.free(0)
    answered = bob.on_free_handle(proposal)
    assert isinstance(answered, Freed) and answered.reply is not None
    assert 0 not in bob.theirs and bob.ours.dereference(0) == "bob's"
    assert alice.on_free_handle(answered.reply) == Freed(handle=0, reply=None, deleted=True)
    assert 0 not in alice.ours and alice.theirs.dereference(0) == "bob's"
    assert alice.table(created_by_us=False) is alice.theirs


def test_a_free_handle_of_another_type_is_refused() -> None:
    space: HandleSpace[str] = HandleSpace(STREAM)
    with pytest.raises(ValueError):
        space.on_free_handle(FreeHandle(handle_type=HandleType.SCHEMA, handle=0, mine=True))


def test_statistics_count_states_and_references() -> None:
    creator, other = pair()
    for name in ("a", "b", "c"):
        bind_both(creator, other, name)
    other.on_reference(0)
    other.on_free(0)
    other.free(1)
    assert other.statistics() == HandleTableStatistics(
        bindings=3, freed_by_us=1, marked_for_deletion=1, references=1, bound_bytes=0
    )


# --- only the creator proposes (headgate's sessions) --------------------------------


def creator_rule_pair() -> tuple[HandleTable[str], HandleTable[str]]:
    return (
        HandleTable(STREAM, created_by_us=True, free_rule=FreeRule.CREATOR),
        HandleTable(STREAM, created_by_us=False, free_rule=FreeRule.CREATOR),
    )


def test_under_the_creator_rule_the_peer_cannot_propose_to_free_our_handle() -> None:
    creator, other = creator_rule_pair()
    handle = bind_both(creator, other, "fetch")
    with pytest.raises(HandleError) as caught:
        creator.on_free(handle)  # the other peer's proposal
    assert caught.value.code is ErrorCode.UNEXPECTED_FRAME
    # Refused, nothing changed: the creator still uses its handle.
    assert creator.state(handle) is BindingState.LIVE
    assert creator.use(handle) == "fetch"


def test_under_the_creator_rule_the_peer_confirms_the_creators_proposal() -> None:
    creator, other = creator_rule_pair()
    handle = bind_both(creator, other, "fetch")
    proposal = creator.free(handle)
    answered = other.on_free(proposal.handle)
    assert isinstance(answered, Freed) and answered.reply is not None
    assert creator.on_free(handle) == Freed(handle=handle, reply=None, deleted=True)
    # A second confirmation is a double free, as under the seed's rule.
    with pytest.raises(HandleError) as caught:
        creator.on_free(handle)
    assert caught.value.code is ErrorCode.HANDLE_FREED


def test_under_the_creator_rule_we_do_not_propose_to_free_the_peers_handle() -> None:
    creator, other = creator_rule_pair()
    handle = bind_both(creator, other, "stream")
    with pytest.raises(ValueError, match="only the peer frees it"):
        other.free(handle)
    assert other.state(handle) is BindingState.LIVE
