"""aggd worker library: allreduce float tensors through an aggd in-network aggregator.

>>> from aggd_client import AggClient
>>> with AggClient(("10.0.0.1", 47000), job=3, rank=0, world=4, group=("239.1.1.3", 47001)) as c:
...     summed = c.allreduce(grads)            # doctest: +SKIP

Or join a job the daemon manages (``aggctl jobs create``) with its token; the answer carries the
job's id, world, group, packet size and slots:

>>> with join(("10.0.0.1", 47000), "resnet", rank=0, token=TOKEN) as c:  # doctest: +SKIP
...     summed = c.allreduce(grads)

A job on several aggregator hosts (each tensor cut among them by weight: ``shards``):

>>> with join_all([("10.0.0.1", 47000), ("10.0.0.2", 47000)], "resnet", 0, TOKEN) as c:  # doctest: +SKIP
...     summed = c.allreduce(grads)
"""
from .client import AggClient, AllreduceHandle, StrategyInfo, WouldBlock
from .errors import (AggdError, AggregationOverflowError, BadTokenError, NoAnswerError, NotMemberError,
                     ProtocolError, UnknownJobError)
from .membership import JobInfo, join
from .shards import ShardedClient, ShardMap, join_all

__version__ = "0.1.0"

__all__ = ["AggClient", "AggdError", "AggregationOverflowError", "AllreduceHandle", "BadTokenError",
           "JobInfo", "NoAnswerError", "NotMemberError", "ProtocolError", "ShardMap", "ShardedClient",
           "StrategyInfo", "UnknownJobError", "WouldBlock", "join", "join_all", "__version__"]
