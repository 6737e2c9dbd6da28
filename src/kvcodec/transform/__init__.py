"""Transform coding of KV caches: pure math (RoPE removal, PCA per group of layers, bit
allocation, quantization of coefficients) and the versioned calibration file (.kvt).

The codec that uses it is kvcodec.codecs.transform.codec.TransformCodec; `kvcodec calibrate` writes
.kvt files. See docs/TRANSFORM.md.
"""

from kvcodec.transform.calibration import Calibration, GroupBasis, calibrate
from kvcodec.transform.kvt import load_kvt, save_kvt
from kvcodec.transform.rope import RopeSpec

__all__ = ["Calibration", "GroupBasis", "RopeSpec", "calibrate", "load_kvt", "save_kvt"]
