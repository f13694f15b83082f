"""Public test helpers for trio_pd."""

from .explorer import Deadlock as Deadlock
from .explorer import ExplorationResult as ExplorationResult
from .explorer import Failure as Failure
from .explorer import Livelock as Livelock
from .explorer import Schedule as Schedule
from .explorer import ScheduleMismatch as ScheduleMismatch
from .explorer import assert_all_schedules as assert_all_schedules
from .explorer import explore as explore
from .explorer import hook_available as hook_available
from .explorer import replay as replay
