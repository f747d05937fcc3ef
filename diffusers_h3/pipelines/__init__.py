from .export import VideoWriter, check_output_path, export_to_video
from .loading import NotAnH3CheckpointError, classify_checkpoint
from .pipeline_minimax_h3 import MiniMaxH3Pipeline, MiniMaxH3PipelineOutput


__all__ = [
    "MiniMaxH3Pipeline",
    "MiniMaxH3PipelineOutput",
    "NotAnH3CheckpointError",
    "VideoWriter",
    "check_output_path",
    "classify_checkpoint",
    "export_to_video",
]
