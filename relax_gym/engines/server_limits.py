"""The bounds of one `relax-gym serve` process, in one validated place: the CLI's flags are made from them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from relax_gym.web.bounds import Bounds


class ServerLimits(BaseModel):
    """Bounds of one `relax-gym serve` process; the defaults suit a rollout fleet on one host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_mb: float = Field(32.0, gt=0, description="largest request body (media are inline base64)")
    max_pending: int = Field(256, ge=1, description="samples queued or running (a chat's n counts n); when full, "
                             "the largest requests yield to smaller ones, else 503")
    request_timeout_s: float = Field(600.0, gt=0, description="a request still generating then ends, 'abort'")
    read_timeout_s: float = Field(30.0, gt=0, description="time for a request's header and body to arrive")
    max_image_pixels: int = Field(12_845_056, ge=1, description="pixels of one image, checked before decoding")
    max_audio_s: float = Field(300.0, gt=0, description="seconds of one audio clip, checked before decoding")
    max_media_items: int = Field(32, ge=0, description="images, audio clips and videos in one request")
    max_video_frames: int = Field(64, ge=1, description="frames of one video, counted as they decode")
    max_media_mb: float = Field(256.0, gt=0, description="decoded media of one request, summed over its items, "
                                "counted from headers before each item (a video's each frame) decodes")
    context_length: int | None = Field(None, ge=2, description="prompt + max_new_tokens bound; default the model's")
    health_timeout_s: float = Field(20.0, gt=0, description="/health_generate's bound on its one-token probe")
    drain_timeout_s: float = Field(10.0, ge=0, description="on SIGTERM, time for requests in flight to finish")
    max_connections: int = Field(1024, ge=1, description="open connections; past it the oldest idle one is closed")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    @property
    def max_media_bytes(self) -> int:
        return int(self.max_media_mb * 2**20)

    @property
    def bounds(self) -> Bounds:
        return Bounds(self.max_body_bytes, self.read_timeout_s, self.max_connections)
