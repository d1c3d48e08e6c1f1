"""Save: classify leaves, plan blobs, stage and upload them, commit the manifest."""
