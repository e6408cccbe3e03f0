"""Who preprocesses the images of requests from SMG (the engine's --mm-processor), as the worker
tells SMG in GetServerInfo's mm_processor. Torch-free: the CLI lists them in its help."""

MM_PROCESSORS = {
    "inprocess": "SMG forwards each image's URL (media_refs) and the engine loads and preprocesses it "
                 "under its media flags, as for its own clients",
    "router": "SMG loads and preprocesses images itself (its media flags apply) and sends the patches "
              "(mm_inputs); this spends the router's CPU instead of the engine host's",
}
