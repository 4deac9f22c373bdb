/* The pod sandbox's pause process for hack/localnode.py's node: it holds the pod's namespaces
 * and reaps orphans until told to stop. Built `gcc -static` and committed FROM scratch as the
 * image containerd names as sandbox_image (nothing can be pulled here). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) { (void)sig; _exit(0); }

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction stop = {.sa_handler = on_stop}, child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &stop, NULL);
  sigaction(SIGTERM, &stop, NULL);
  sigaction(SIGCHLD, &child, NULL);
  for (;;) pause();
}
