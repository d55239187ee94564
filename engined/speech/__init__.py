"""Speech to text: Whisper models, transcriptions batched across requests.

A Whisper folder (CTranslate2, Hugging Face or mlx-community: ``checkpoints``) gets an engine of
its own (``engine.SpeechEngine``, which the daemon runs in the decoder ``Engine``'s place): audio
arrives as 16 kHz samples in ``AddRequest.audio``, ``features`` turns it into log-mel windows,
``whisper`` is the model, ``step`` its batched decoder step as one compiled graph, ``decoding``
holds Whisper's token rules and segment timing, and ``transcription`` one request's progress
through its file.
"""
