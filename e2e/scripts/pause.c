/* The pod sandbox process of the e2e kubelets (their pause image, see build-image.sh): it holds
 * the pod's namespaces and does nothing else. It sleeps until SIGTERM or SIGINT, then exits 0 at
 * once; as PID 1 of a pod's shared PID namespace it reaps the orphans reparented to it.
 * Build: cc -static -Os -s -o pause pause.c  (static: the image holds this file only). */
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "1.0"

static void down(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  int saved = errno;
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {}
  errno = saved;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    static const char v[] = "pause " VERSION "\n";
    return write(STDOUT_FILENO, v, sizeof v - 1) == (ssize_t)(sizeof v - 1) ? 0 : 1;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = down;
  if (sigaction(SIGINT, &sa, NULL) < 0 || sigaction(SIGTERM, &sa, NULL) < 0) return 1;
  sa.sa_handler = reap;
  sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  if (sigaction(SIGCHLD, &sa, NULL) < 0) return 2;
  reap(0); /* children that ended before the handler was in place */
  for (;;) pause();
}
