"""Where and how a model runs: device, distributed group, precision, compilation, inference preparation and
calibration: every ``auto`` speed decision is a timing on this machine (docs: Speed)."""
from .calibrate import Calibration, fingerprint
from .compile import compile_for_training, has_cxx_compiler
from .device import resolve_device
from .distributed import destroy_process_group, init_distributed, rank_and_world
from .inference import InferenceModel, choose_inference_dtype, optimize_for_inference
from .precision import DTYPES, PRECISIONS, autocast_for, dtype_of, precision_of

__all__ = ["Calibration", "DTYPES", "PRECISIONS", "InferenceModel", "autocast_for",
           "choose_inference_dtype", "compile_for_training", "destroy_process_group", "dtype_of", "fingerprint",
           "has_cxx_compiler", "init_distributed", "optimize_for_inference", "precision_of", "rank_and_world",
           "resolve_device"]
