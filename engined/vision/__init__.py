"""Images in: the vision tower and projector of a vision-language checkpoint, run inside the packed step.

A checkpoint whose config.json has a ``vision_config`` gets a ``tower.VisionTower`` beside its text
model (``loaders.mlx_dir``): mlx-vlm's own tower and projector classes with the checkpoint's
weights. The gateway expands each image's placeholder into the model's run of image tokens and
sends the processed pixels with the prompt (``shared.protocol.ImageInput``); the runner asks
``embeds.ImageEmbeds`` for the rows of a step that fall on image tokens, and the text model reads
those rows in place of the placeholder tokens' embeddings. Everything else in the step (paged
attention, chunked prefill, prefix caching, sampling) is the text model's own.
"""
