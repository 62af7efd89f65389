"""Chat content parts for the media tests: deterministic noise images, videos of them, text."""

from __future__ import annotations

from tito.v1 import chat_pb2

from images import noise_png


def image(width: int, height: int, seed: int) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=noise_png(width, height, seed)))


def video(frames: int, fps: float, seed: int, width: int = 56, height: int = 56) -> chat_pb2.ContentPart:
    """`frames` noise frames (seeds `seed`, `seed + 1`, ...) at `fps`."""
    return chat_pb2.ContentPart(video=chat_pb2.VideoFrames(
        frames=[chat_pb2.ImageSource(data=noise_png(width, height, seed + k)) for k in range(frames)], fps=fps))


def text(value: str) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(text=value)
