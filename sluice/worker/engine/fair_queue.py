"""The waiting queue: one FIFO per group (an API request's prompts × n), groups in a
rotation, so admission can go round-robin across requests instead of first-come-first-served
across sequences — 16,000 sequences of one request no longer sit ahead of everyone else::

    rotation (front first):  g2 ─ g7 ─ g3
    g2: [s4 s5 s6]           pop(g2) takes s4 and sends g2 to the back: g7 ─ g3 ─ g2
    g7: [s9]                 push_front(s1 of g3, resume_first=True): g3 ─ g7 ─ g2
    g3: [s1 s2]

Every operation is O(1) (ordered dicts), whatever the number of sequences or groups, except
iteration; in particular ``remove`` (an abort) is O(1), where a deque's is O(N).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from sluice.worker.engine.sequence import Sequence


class FairQueue:
    """Waiting sequences grouped by ``Sequence.group``."""

    def __init__(self) -> None:
        self._groups: OrderedDict[str, OrderedDict[Sequence, None]] = OrderedDict()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, group by group in rotation order."""
        for queue in self._groups.values():
            yield from queue

    def __contains__(self, seq: Sequence) -> bool:
        queue = self._groups.get(seq.group)
        return queue is not None and seq in queue

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def has_group(self, group: str) -> bool:
        return group in self._groups

    def group_size(self, group: str) -> int:
        """Waiting sequences of ``group``."""
        queue = self._groups.get(group)
        return 0 if queue is None else len(queue)

    def groups(self) -> Iterator[str]:
        """Groups with waiting sequences, front of the rotation first."""
        return iter(self._groups)

    def append(self, seq: Sequence) -> None:
        """Queue ``seq`` at the back of its group; a new group joins the back of the
        rotation."""
        queue = self._groups.get(seq.group)
        if queue is None:
            queue = self._groups[seq.group] = OrderedDict()
        queue[seq] = None
        self._len += 1

    def push_front(self, seq: Sequence, resume_first: bool) -> None:
        """Queue a preempted ``seq`` first in its group. ``resume_first``: its group also
        goes to the front of the rotation (a memory preemption resumes before anything new,
        as vLLM does); else the group keeps its place (a preemption made to let another
        group in must not hand the slot straight back)."""
        queue = self._groups.get(seq.group)
        if queue is None:
            queue = self._groups[seq.group] = OrderedDict()
        queue[seq] = None
        queue.move_to_end(seq, last=False)
        if resume_first:
            self._groups.move_to_end(seq.group, last=False)
        self._len += 1

    def peek(self, group: str) -> Sequence:
        """The first waiting sequence of ``group`` (which must have one)."""
        return next(iter(self._groups[group]))

    def pop(self, group: str) -> Sequence:
        """Take the first sequence of ``group`` and send the group to the back of the
        rotation (or drop it once empty)."""
        queue = self._groups[group]
        seq, _ = queue.popitem(last=False)
        if queue:
            self._groups.move_to_end(group)
        else:
            del self._groups[group]
        self._len -= 1
        return seq

    def remove(self, seq: Sequence) -> bool:
        """Drop ``seq`` if it waits here; returns whether it did."""
        queue = self._groups.get(seq.group)
        if queue is None or seq not in queue:
            return False
        del queue[seq]
        if not queue:
            del self._groups[seq.group]
        self._len -= 1
        return True
