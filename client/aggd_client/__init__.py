"""aggd worker library: allreduce float tensors through an aggd in-network aggregator.

>>> from aggd_client import AggClient
>>> with AggClient(("10.0.0.1", 47000), job=3, rank=0, world=4, group=("239.1.1.3", 47001)) as c:
...     summed = c.allreduce(grads)            # doctest: +SKIP

Or join a job the daemon manages (``aggctl jobs create``) with its token; the answer carries the
job's id, world, group, packet size and slots:

>>> with join(("10.0.0.1", 47000), "resnet", rank=0, token=TOKEN) as c:  # doctest: +SKIP
...     summed = c.allreduce(grads)
"""
from .client import AggClient, AllreduceHandle, StrategyInfo, WouldBlock
from .errors import (AggdError, AggregationOverflowError, BadTokenError, NoAnswerError, NotMemberError,
                     ProtocolError, UnknownJobError)
from .membership import JobInfo, join

__version__ = "0.1.0"

__all__ = ["AggClient", "AggdError", "AggregationOverflowError", "AllreduceHandle", "BadTokenError",
           "JobInfo", "NoAnswerError", "NotMemberError", "ProtocolError", "StrategyInfo",
           "UnknownJobError", "WouldBlock", "join", "__version__"]
