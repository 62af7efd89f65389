"""The native backend's process structure: `Engine` in the serving process, the step loop
(`EngineCore`) in a child process or a thread, and the messages that cross the pipe between them."""
