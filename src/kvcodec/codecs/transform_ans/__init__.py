"""The transform codec with its integers entropy-coded for the SMs (issue 21's alternative to NVDEC):
rans (interleaved rANS, pure numpy), gpu (the Triton decoder), header (the KVTA chunk header),
codec (TransformAnsCodec, registered as "transform-ans")."""
