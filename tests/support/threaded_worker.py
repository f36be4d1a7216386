"""`engines.llama_worker` in a process where another thread already runs when it confines itself,
as a GPU driver's might: Landlock would not confine that thread, so the sandbox must refuse."""

import threading
import time

from engines import llama_worker

if __name__ == "__main__":
    threading.Thread(target=time.sleep, args=(600,), daemon=True, name="driver").start()
    llama_worker.main()
