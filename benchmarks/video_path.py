"""Video through the processor: frames/s of a clip against the same frames sent as separate images.

For each frame size, `--clips` clips of `--frames` random frames go through `encode_media` (the rollout's
path: the model's processor, `FramesVideoProcessor` for the video) one clip per call, and the same frames
go through it as `--frames` images per call (the image processor: one 2-frame temporal patch per image, so
twice the patches of the clip). Both on tiny-vl's processor (Qwen3-VL: 16 px patches merged 2x2) with a
pixel budget large enough that no frame is resized down; interleaved, median of `--repeats`.

    python benchmarks/video_path.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from PIL import Image

from relax_gym.models import encode_media, load_model
from relax_gym.video import video_from_frames

SIZES = ((64, 64), (224, 224), (448, 448))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--clips", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loaded = load_model("tiny-vl")
    processor = loaded.processor
    big = {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 448 * 448}
    processor.video_processor.size = big
    processor.image_processor.size = {"shortest_edge": 4 * 32 * 32, "longest_edge": 448 * 448}
    rng = np.random.default_rng(0)
    print(f"tiny-vl processor, {args.clips} clips of {args.frames} frames per measurement, median of "
          f"{args.repeats}\n")
    print("| frame size | video: frames/s | as images: frames/s | video / images | tokens per clip: video | "
          "as images |")
    print("|---|---:|---:|---:|---:|---:|")
    for height, width in SIZES:
        clips = [[Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
                  for _ in range(args.frames)] for _ in range(args.clips)]
        videos = [video_from_frames(frames, 2.0) for frames in clips]
        video_text = processor.video_token
        image_text = processor.image_token * args.frames
        times: dict[str, list[float]] = {"video": [], "images": []}
        tokens = {}
        for _ in range(args.repeats):
            start = time.perf_counter()
            for video in videos:
                out = encode_media(loaded, video_text, videos=[video])
            times["video"].append(time.perf_counter() - start)
            tokens["video"] = out["input_ids"].shape[1]
            start = time.perf_counter()
            for frames in clips:
                out = encode_media(loaded, image_text, images=frames)
            times["images"].append(time.perf_counter() - start)
            tokens["images"] = out["input_ids"].shape[1]
        rate = {k: args.clips * args.frames / statistics.median(v) for k, v in times.items()}
        print(f"| {width}x{height} | {rate['video']:.0f} | {rate['images']:.0f} | "
              f"{rate['video'] / rate['images']:.2f} | {tokens['video']} | {tokens['images']} |")


if __name__ == "__main__":
    main()
