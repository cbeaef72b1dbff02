"""The write path: the engine that runs a snapshot's stages, the persist job, the local
writer, the upload, and the one manifest builder."""
