"""The leader/follower family: HeteroCache and SyncKV.

Leader heads keep every token on the device and choose which prompt tokens their follower heads hold; followers keep
their whole prompt KV in host memory and take the chosen rows from it. :mod:`.layout` is the cache layout,
:mod:`.scores` the attention scores leaders choose by, :mod:`.schedules` how followers follow in decode steps,
:mod:`.base` the shared lifecycle; each method supplies its plans, prefill selection and leaders' decision.
"""

from kvjax.methods.recall.base import LeaderFollowerMethod
from kvjax.methods.recall.heterocache import HeteroCache
from kvjax.methods.recall.schedules import RECALL_SCHEDULES
from kvjax.methods.recall.synckv import SyncKV

__all__ = ["LeaderFollowerMethod", "HeteroCache", "SyncKV", "RECALL_SCHEDULES"]
