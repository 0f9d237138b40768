"""specmesh: lossless speculative decoding with expert drafters, fused token trees and tree verification."""

__version__ = "0.1.0"
