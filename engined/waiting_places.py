"""Places in an engine's waiting queue, taken by whole client requests (``--max-waiting-requests``)."""

from __future__ import annotations

from shared.errors import OverloadedError


class WaitingPlaces:
    """Counts requests against the waiting queue's cap, a client request's members all or none.

    Every prompt (and choice) of a client request is a request, sent one
    after another as one ``group``. Its first member decides for all: it
    reserves places for the rest, or is refused and so are they. One
    request asking for more than the queue holds thus never holds places
    that requests beside it needed, only to be refused on a later member.
    """

    def __init__(self, cap: int):
        self.cap = cap
        # Client requests whose later members are still to arrive: group -> (members left, refused),
        # and the waiting places reserved for them.
        self._groups: dict[str, tuple[int, bool]] = {}
        self._reserved = 0

    def take(self, group: str | None, group_size: int, num_waiting: int) -> None:
        """Count one request while ``num_waiting`` wait; raises OverloadedError past the cap."""
        cap = self.cap
        entry = self._groups.get(group) if group is not None else None
        if entry is not None:  # a later member: its fate was decided by the first
            left, refused = entry
            if left > 1:
                self._groups[group] = (left - 1, refused)
            else:
                del self._groups[group]
            if refused:
                raise OverloadedError(f"this request's {group_size} prompts x choices do not fit the waiting "
                                      f"queue (--max-waiting-requests {cap}); retry later")
            self._reserved -= 1
            return
        need = max(1, group_size)
        waiting = num_waiting + self._reserved
        refused = waiting + need > cap
        if group is not None and need > 1:
            self._groups[group] = (need - 1, refused)
            if not refused:
                self._reserved += need - 1
        if refused:
            raise OverloadedError(
                f"{waiting} requests are already waiting and this one needs {need} places "
                f"(--max-waiting-requests {cap}); retry later" if need > 1 else
                f"{waiting} requests are already waiting (--max-waiting-requests {cap}); retry later"
            )
