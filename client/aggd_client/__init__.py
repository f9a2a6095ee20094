"""aggd worker library: allreduce float tensors through an aggd in-network aggregator.

>>> from aggd_client import AggClient
>>> with AggClient(("10.0.0.1", 47000), job=3, rank=0, world=4, group=("239.1.1.3", 47001)) as c:
...     summed = c.allreduce(grads)            # doctest: +SKIP
"""
from .client import AggClient
from .errors import (AggdError, AggregationOverflowError, NoAnswerError, NotMemberError,
                     ProtocolError, UnknownJobError)

__version__ = "0.1.0"

__all__ = ["AggClient", "AggdError", "AggregationOverflowError", "NoAnswerError", "NotMemberError",
           "ProtocolError", "UnknownJobError", "__version__"]
