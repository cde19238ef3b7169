"""The online store's Lua scripts: package data (``online/scripts/*.lua``), read once per process.

Each script is called by its SHA-1 (EVALSHA); a Redis that lost its scripts (a restart, a
promoted replica) is sent their text again and the calls, all idempotent, are retried.

Every script starts with ``PROLOGUE``: a call may also come with no declared keys and its keys
ahead of its arguments (``EVALSHA sha 0 n key1 … keyn arg1 …``). A cluster node runs such a call
over keys of every slot it holds, where declared keys must share one slot (one call per node,
not per slot); the script body sees ``KEYS`` and ``ARGV`` as if they had been declared. A script
whose first line is ``-- needs: _<library>.lua`` gets that library's text next (shared functions).

A script that writes ends with ``return garbage_taken_out(result)``: Redis's Lua collects garbage
incrementally, as later scripts allocate, so the megabytes a large write leaves would be swept
during the next scripts to run, a lookup's among them (the slowest of them several times their
usual Redis time). The writer collects instead, once it grew the heap by more than the little a
read leaves, or left it larger than a few times what the scripts' own code holds. By its growth
first: that code is most of the heap after a collection (it grew with the scripts to about the
bound once set on the whole heap), and a whole collection after every small write (a packing
run's, a few events each) cost Redis more than the write's own work.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

GARBAGE_KB = 256  # the Lua garbage a writer may leave for the scripts after it to sweep (``garbage_taken_out``)
HEAP_MOST_KB = 1024  # the Lua heap a writer leaves at most (the scripts' code holds about a quarter)
PROLOGUE = """\
local KEYS, ARGV, heap_at_start = KEYS, ARGV, collectgarbage('count')
if #KEYS == 0 and #ARGV > 0 then  -- (keys undeclared, ahead of the arguments: see featurestore/online/lua.py)
  local n, keys, args = tonumber(ARGV[1]), {}, {}
  for i = 1, n do keys[i] = ARGV[i + 1] end
  for i = n + 2, #ARGV do args[i - n - 1] = ARGV[i] end
  KEYS, ARGV = keys, args
end
local function garbage_taken_out(result)  -- (a writer's last step: see featurestore/online/lua.py)
  local heap = collectgarbage('count')
  if heap - heap_at_start > GARBAGE_KB or heap > HEAP_MOST_KB then collectgarbage() end
  return result
end
""".replace("GARBAGE_KB", str(GARBAGE_KB)).replace("HEAP_MOST_KB", str(HEAP_MOST_KB))


@dataclass(frozen=True)
class Script:
    """A Lua script's text and SHA-1, as EVALSHA needs them."""

    name: str
    code: str

    @functools.cached_property
    def sha(self) -> str:
        return hashlib.sha1(self.code.encode()).hexdigest()


@functools.cache
def scripts() -> dict[str, Script]:
    """``{name: script}`` for every ``scripts/<name>.lua``."""
    folder = resources.files("featurestore.online") / "scripts"
    texts = {entry.name: entry.read_text() for entry in folder.iterdir() if entry.name.endswith(".lua")}

    def code(text: str) -> str:
        first = text.split("\n", 1)[0]
        library = first.removeprefix("-- needs: ") if first.startswith("-- needs: ") else None
        return PROLOGUE + (texts[library] if library else "") + text

    return {
        name.removesuffix(".lua"): Script(name.removesuffix(".lua"), code(text))
        for name, text in texts.items()
        if not name.startswith("_")
    }
