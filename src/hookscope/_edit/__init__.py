"""Edit: change what chosen modules return or take, scoped to a ``with`` block.

``editor`` attaches the hooks and checks what edits return; ``part`` turns ``channels=``,
``neurons=``, ``positions=``, ``heads=`` and ``mask=`` into a mask; ``context`` is what an edit
function is told. The built-in edits are in :mod:`hookscope.edits`.
"""

from hookscope._edit.context import EditContext
from hookscope._edit.editor import Editor, edit, run_with_edits
from hookscope._edit.options import EditOptions

__all__ = ["EditContext", "EditOptions", "Editor", "edit", "run_with_edits"]
