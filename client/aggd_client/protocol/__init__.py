"""aggd wire protocol: the definition and everything derived from it."""
from .definition import *  # noqa: F401,F403
from .codec import (HEADER_DTYPE, HEADER_SIZE, HEADER_STRUCT, PAYLOAD_DTYPE, Header, decode,  # noqa: F401
                    encode, packet_dtype, payload_dtype)
