"""The engine's torch-free core: requests, the paged KV block manager and the scheduler.

Nothing under `core/` imports torch (a test checks it), so it runs and is tested
anywhere, fast, with hand-built model outputs.
"""

from kvfleet.engine.core.block_pool import BlockPool
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.request import Request, RequestStatus
from kvfleet.engine.core.runner_output import ModelRunnerOutput, PromptLogprob, SampleLogprobs
from kvfleet.engine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = [
    "BlockPool",
    "KVCacheManager",
    "ModelRunnerOutput",
    "PromptLogprob",
    "Request",
    "RequestStatus",
    "SampleLogprobs",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
]
