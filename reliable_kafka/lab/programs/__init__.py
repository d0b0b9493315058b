"""Small client programs that the lab and the crash tests run as child processes and SIGKILL."""
