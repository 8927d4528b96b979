/*
 * celery-dlock's lock protocol, as implemented (celery_dlock/backends/redis/scripts.py,
 * core/hold.py, core/scheduler.py, core/deadline.py), checked with spin.  See
 * docs/protocol.md for the prose.
 *
 * Two clients (owners 1 and 2) each take one lock (possibly re-entering it), write to a
 * fenced resource while they believe they hold it, and release.  A heartbeat renews
 * each hold; a watchdog (a process of its own, as the scheduler's watchdog thread is
 * apart from the renewer threads) tells its client at the hold's local deadline.  The
 * server runs each script atomically.  Time is a tick counter; the server's clock
 * (s_clock, for fences) advances at every script call and with time, never back.
 *
 * Faults: the reply of any acquire or release may be lost once per client (the client
 * re-sends the same operation id, as redis-py's Retry does); requests (renewals
 * included) and replies are delayed while time passes; a client may die at any step (its hold then expires); the server's clock may
 * run DRIFT ticks ahead of the client's over a ttl; the watchdog may be paused up to
 * PAUSE ticks.  With -DRENEW_HANG a renewal may never be answered (the renewer gives
 * up after RENEW_TIMEOUT, as its socket timeout does); with -DFORCE an operator may
 * free the hold by force once (celery dlock release --force); with -DDATA_LOSS the
 * server may lose all its data once (an empty restart, a failover that missed the
 * writes): the hold, the fence counter and the operation ids, but not its clock.
 * Under FORCE and DATA_LOSS "told first" cannot hold (the hold is gone at once): the
 * properties checked are the fence's and that the holder is told at its next contact.
 *
 * Switches (pass with spin -D...), each a mutant that must produce a counterexample:
 *   NO_OPID       the scripts ignore operation ids (a re-sent call runs twice)
 *   NO_RELEASE_MEMORY a re-sent final release is not recognised (the fence counter
 *                 says nothing of how a hold ended): a release is reported lost
 *   NO_DEADLINE   no watchdog: a hold is lost only when a renewal reply says so
 *   SHORTEN       re-entry and renewal set the expiry even when that brings it closer
 *   NO_FENCE_CHECK the resource accepts every write
 *   WATCHDOG_IN_RENEWER the watchdog runs in the renewer's loop, which waits for a
 *                 renewal's reply without a bound: a renewal that never answers
 *                 keeps the holder from being told (the clock cannot pass the
 *                 deadline: an invalid end state, the deadlock check's to find)
 *   NO_RENEW_TIMEOUT the renewer waits for a reply without a bound: a renewal that
 *                 never answers leaves it blocked for good (an invalid end state:
 *                 shows the deadlock check is on)
 *   OLD_REENTRY   a re-entry whose hold is gone takes a new hold silently (the bug
 *                 of a force release or data loss followed by a nested acquire)
 *   OLD_FENCE     the fence is the counter + 1 only: it repeats after a data loss
 *   NO_LINE_FLAG  a waiter joins the line without flagging the hold: its holder's
 *                 release, which reads the line only when flagged, would not ring
 *   PAUSE=k       a pause longer than the margin allows (told-first may fail; fencing
 *                 must still hold: run with -DBEYOND_BOUND to check only fencing)
 */

#ifndef TTL
#define TTL 4
#endif
#ifndef MARGIN
#define MARGIN 2          /* drift + pause allowance, as lease_end() in core/deadline.py */
#endif
#ifndef DRIFT
#define DRIFT 1           /* server clock ahead of the client's over one ttl */
#endif
#ifndef PAUSE
#define PAUSE 0           /* longest watchdog pause; the guarantee needs MARGIN > DRIFT + PAUSE */
#endif
#ifndef MAXT
#define MAXT 9
#endif
#ifndef INNER_TTL
#define INNER_TTL 2       /* ttl of the re-entering lock object: shorter than TTL */
#endif
#ifndef RENEW_AHEAD
#define RENEW_AHEAD 1     /* renew this many ticks before the local deadline */
#endif
#ifndef RENEW_TIMEOUT
#define RENEW_TIMEOUT 2   /* the renewer gives up on a reply after this (socket timeout) */
#endif
#define CLOCK_RATE 4      /* server clock units (microseconds) per tick, at least */
#define GRACE 1           /* a woken waiter's grace (WAKE_GRACE) */
#define NONE 0
/* "told first" is checked unless a run goes beyond its assumptions on purpose */
#if !defined(BEYOND_BOUND) && !defined(FORCE) && !defined(DATA_LOSS)
#define TOLD_FIRST
#endif

/* request kinds */
#define ACQ 1
#define REL 2
#define REN 3

/* reply status */
#define OK 1
#define FAIL 0
#define GONE 2
#define TAKEN 3

byte now = 0;

/* -- the server: one lock hash, its fence counter, the line (one waiter) ----------- */
byte s_owner = NONE;
byte s_count = 0;
byte s_fence = 0;
byte s_expiry = 0;
byte fence_ctr = 0;
byte s_clock = 0;        /* the server's clock in fence units: never goes back */
byte max_fence = 0;      /* the highest fence ever handed out (for the property) */
bool renew_drop[3];      /* one renewal per client may go unanswered (RENEW_HANG) */
bool waiting[3];         /* the renewer is waiting for a renewal's reply */
byte s_lastop[3];        /* last operation id applied per owner (ops field) */
byte s_prev = 0;         /* the counter the current hold's grant found (its hash's prev) */
/* ghosts, for the properties only */
bool gone_by_loss[3];    /* the client's hold ended otherwise than by its release */
bool ended_since[3];     /* another hold ended since the client's final release */
byte s_waiter = NONE;    /* the first in line */
byte s_promise_end = 0;  /* a free lock is promised to s_waiter until then */
bool s_line = false;     /* the hold's hash says: someone joined the line during it */

/* -- the resource: accepts a write whose fence is at least the highest seen ------- */
byte res_max = 0;
byte res_last = 0;       /* fence of the last accepted write */

/* -- each client's view ------------------------------------------------------------ */
bool alive[3];
bool in_cs[3];           /* inside the body: may write to the resource */
bool held[3];            /* a hold registered locally (acquire confirmed, not released) */
bool lost[3];            /* told: on_lost fired */
byte deadline[3];        /* local deadline of the hold */
byte mycount[3];         /* local hold count */
byte myfence[3];
bool drop_budget[3];     /* one lost reply per client */

chan req = [4] of { byte, byte, byte, byte, byte, bool };
                 /* client, kind, op id, send time, ttl, re-entry (expects its hold) */
chan rep[3] = [1] of { byte, byte };           /* status, value: to the client */
chan hbrep[3] = [1] of { byte, byte };         /* status, send time: to its renewer */
bool dropped[3];         /* the reply of the client's last request was lost */

inline expire() {
  if
  :: s_owner != NONE && now >= s_expiry ->
     gone_by_loss[s_owner] = true; ended_since[3 - s_owner] = true;
     s_owner = NONE; s_count = 0
  :: else -> skip
  fi
}

inline extend_to(t) {
#ifdef SHORTEN
  s_expiry = t
#else
  if
  :: t > s_expiry -> s_expiry = t
  :: else -> skip
  fi
#endif
}

inline reply(c, st, v) {
  if
  :: drop_budget[c] -> drop_budget[c] = false; dropped[c] = true
  :: true -> rep[c]!st, v
  fi
}

/* The next fence: max(counter + 1, the server's clock), so that a counter lost with
 * the server's data starts again above every fence handed out (docs/fencing.md). */
inline next_fence() {
#ifdef OLD_FENCE
  fence_ctr++;
#else
  if
  :: fence_ctr + 1 > s_clock -> fence_ctr++
  :: else -> fence_ctr = s_clock
  fi;
#endif
  assert(fence_ctr > max_fence);   /* fences never repeat, nor go back */
  max_fence = fence_ctr
}

inline renew_reply(c, st, sent) {
  /* a reply to a renewer that gave up is dropped (its connection was closed) */
  if
  :: nfull(hbrep[c]) -> hbrep[c]!st, sent
  :: full(hbrep[c]) -> skip
  fi
}

proctype Server() {
  byte c, kind, op, sent, ttl;
  bool reentry;
  byte other, before, st_ren;
end_server:
  do
  :: req?c, kind, op, sent, ttl, reentry ->
     atomic {
       expire();
       /* the clock moves at every script call, and with time */
       if
       :: s_clock + 1 > now * CLOCK_RATE -> s_clock++
       :: else -> s_clock = now * CLOCK_RATE
       fi;
       other = 3 - c;
       if
       :: kind == ACQ ->
          if
          :: s_owner == c ->
#ifndef NO_OPID
             if
             :: s_lastop[c] == op -> reply(c, OK, s_fence)   /* a re-send: no change */
             :: else ->
#endif
                before = s_expiry;
                s_count++; s_lastop[c] = op;
                extend_to(now + ttl - DRIFT);
                assert(s_expiry >= before);          /* re-entry never shortens */
                reply(c, OK, s_fence)
#ifndef NO_OPID
             fi
#endif
#ifndef OLD_REENTRY
          :: s_owner != c && reentry ->
             /* the owner expects its hold, which is gone: take nothing */
             if
             :: s_owner == NONE -> reply(c, GONE, 0)
             :: else -> reply(c, TAKEN, 0)
             fi
          :: s_owner == NONE && !reentry && (s_waiter == NONE || s_waiter == c
                                             || now >= s_promise_end) ->
#else
          :: s_owner == NONE && (s_waiter == NONE || s_waiter == c
                                 || now >= s_promise_end) ->
#endif
             /* told first: nobody else still believes it may write */
#ifdef TOLD_FIRST
             assert(!(in_cs[other] && alive[other] && !lost[other]));
#endif
             s_prev = fence_ctr;
             next_fence();
             s_owner = c; s_count = 1; s_fence = fence_ctr; s_lastop[c] = op;
             gone_by_loss[c] = false;
             s_line = false;   /* a new hash (the line is empty after a grant here) */
             s_expiry = now + ttl - DRIFT;
             if
             :: s_waiter == c || now >= s_promise_end -> s_waiter = NONE
             :: else -> skip
             fi;
             reply(c, OK, s_fence)
          :: else ->
             s_waiter = c;                            /* joins the line */
#ifndef NO_LINE_FLAG
             if
             :: s_owner != NONE -> s_line = true      /* ...and flags the hold */
             :: else -> skip
             fi;
#endif
             reply(c, FAIL, 0)
          fi
       :: kind == REL ->
          if
          :: s_owner == c ->
#ifndef NO_OPID
             if
             :: s_lastop[c] == op -> reply(c, OK, s_count)   /* a re-send */
             :: else ->
#endif
                s_count--; s_lastop[c] = op;
                if
                :: s_count == 0 ->
                   /* the counter says: freed by its owner (fence + 1), written
                    * without being read: it never holds more than the hold's fence
                    * then (only this hold's end changes it after its grant) */
                   assert(fence_ctr <= s_fence);
                   fence_ctr = s_fence + 1;
                   s_owner = NONE; ended_since[c] = false; ended_since[other] = true;
                   /* the line is read only when the hold was flagged: a waiter in
                    * line is always behind a flag */
                   assert(s_waiter == NONE || s_line);
                   if
                   :: s_line && s_waiter != NONE -> s_promise_end = now + GRACE /* ring */
                   :: else -> skip
                   fi
                :: else -> skip
                fi;
                reply(c, OK, s_count)
#ifndef NO_OPID
             fi
#endif
          :: else ->
#if !defined(NO_OPID) && !defined(NO_RELEASE_MEMORY)
             /* a re-sent final release: the request names the hold's fence (in the
              * ttl field; 0 for a give-back, which names none), and the counter, or
              * the next hold's prev, says that hold was freed by its owner */
             if
             :: ttl != 0 && ((s_owner == NONE && fence_ctr == ttl + 1)
                             || (s_owner != NONE && s_prev == ttl + 1)) ->
                reply(c, OK, 0)
             :: else ->
                if
                :: s_owner == NONE -> reply(c, GONE, 0)
                :: else -> reply(c, TAKEN, 0)
                fi
             fi
#else
             if
             :: s_owner == NONE -> reply(c, GONE, 0)
             :: else -> reply(c, TAKEN, 0)
             fi
#endif
          fi
       :: kind == REN ->
          if
          :: s_owner == c -> extend_to(now + TTL - DRIFT); st_ren = OK
          :: s_owner == NONE -> st_ren = GONE
          :: else -> st_ren = TAKEN
          fi;
          if
          :: renew_drop[c] -> renew_drop[c] = false     /* never answered */
          :: true -> renew_reply(c, st_ren, sent)
          fi
       fi
     }
  od
}

/* Send a request and wait for its reply, re-sending (same op id) when it was lost. */
inline call(c, kind, op, ttl, st, v, reentry) {
  atomic { op++; sent = now; dropped[c] = false; req!c, kind, op, sent, ttl, reentry };
  do
  :: rep[c]?st, v -> break
  /* the re-send keeps the first send time: the reply may confirm the first execution */
  :: atomic { dropped[c] -> dropped[c] = false; req!c, kind, op, sent, ttl, reentry }
  od
}

inline confirmed(c, t, ttl) {
  if
  :: t + ttl - MARGIN > deadline[c] -> deadline[c] = t + ttl - MARGIN
  :: else -> skip
  fi
}

/* The renewer: renews the hold when it falls due; waits for the reply at most
 * RENEW_TIMEOUT (its socket timeout), then tries again while the hold lasts. */
proctype Renewer(byte c) {
  byte st, rsent, sent;
  byte last = 255;
end_renewer:
  do
  :: atomic { (alive[c] && held[c] && !lost[c] && now + RENEW_AHEAD >= deadline[c] && now != last) ->
       /* renewal falls due (ttl/3 before the end, in ticks) */
       last = now; sent = now; waiting[c] = true; req!c, REN, 0, sent, TTL, false };
     st = NONE;
     do
     :: hbrep[c]?st, rsent ->
        if
        :: rsent == sent -> break
        :: else -> st = NONE              /* a reply to an earlier renewal: ignore */
        fi
#if !defined(WATCHDOG_IN_RENEWER) && !defined(NO_RENEW_TIMEOUT)
     :: now >= sent + RENEW_TIMEOUT -> st = NONE; break
#endif
#ifndef NO_RENEW_TIMEOUT
     :: now == MAXT -> st = NONE; break   /* the run's horizon: nothing moves on */
#endif
     od;
     atomic {
       waiting[c] = false;
       if
       :: st == OK && held[c] && !lost[c] -> confirmed(c, sent, TTL)
       :: (st == GONE || st == TAKEN) && held[c] -> lost[c] = true
       :: else -> skip
       fi
     }
#ifdef WATCHDOG_IN_RENEWER
  /* the old design: the deadline is checked between renewals, in this loop */
  :: atomic { held[c] && !lost[c] && now >= deadline[c] -> lost[c] = true }
#endif
  :: !alive[c] -> break
  od
}

#ifndef WATCHDOG_IN_RENEWER
/* The watchdog: tells the holder at its local deadline, whatever a renewal is doing. */
proctype Watchdog(byte c) {
end_watchdog:
  do
#ifndef NO_DEADLINE
  :: atomic { held[c] && !lost[c] && now >= deadline[c] -> lost[c] = true }
#endif
  :: !alive[c] -> break
  od
}
#endif

#if defined(FORCE) || defined(DATA_LOSS)
/* An operator's force release, or the server losing its data, once, at any moment a
 * hold exists (or never). */
proctype Operator() {
  if
  :: atomic { s_owner != NONE ->
       gone_by_loss[s_owner] = true; ended_since[3 - s_owner] = true;
#ifdef DATA_LOSS
       s_owner = NONE; s_count = 0; fence_ctr = 0; s_waiter = NONE; s_prev = 0;
       s_line = false;
       s_lastop[1] = 0; s_lastop[2] = 0
#else
       /* a force release leaves the counter at fence + 2 (+ a tag of its op id) */
       if
       :: fence_ctr < s_fence + 2 -> fence_ctr = s_fence + 2
       :: else -> skip
       fi;
       s_owner = NONE; s_count = 0
#endif
     }
  :: skip
  fi
}
#endif

proctype Client(byte c; bool reenter) {
  byte st, v, sent;
  byte op = c * 10;
  byte tried, tries = 0;
  bool late;
  /* acquire, waiting in line */
  do
  :: call(c, ACQ, op, TTL, st, v, false);
     if
     :: st == OK ->
        /* register the hold, unless its confirmation came after its deadline */
        atomic {
          if
          :: now < sent + TTL - MARGIN ->
             held[c] = true; lost[c] = false; mycount[c] = 1; myfence[c] = v;
             deadline[c] = sent + TTL - MARGIN; in_cs[c] = true; late = false
          :: else -> late = true
          fi
        };
        if
        :: !late -> break
        :: late ->
           call(c, REL, op, 0, st, v, false);   /* too late to vouch for: give back */
           if
           :: tries < 3 && now < MAXT -> tries++
           :: else -> goto done
           fi
        fi
     :: atomic { st == FAIL && now < MAXT && tries < 3 -> tries++; tried = now };
        (now > tried || now == MAXT)            /* sleep (doorbell or slice), try again */
     :: else -> goto done
     fi
  :: alive[c] = false; goto done                /* killed while waiting */
  od;
  if
  :: reenter && lost[c] -> skip    /* a hold known lost: LockLost, no call */
  :: reenter && !lost[c] ->
     /* re-entry with a shorter ttl (an inner lock object with its own ttl); the
      * request says the owner expects to hold the lock */
     call(c, ACQ, op, INNER_TTL, st, v, true);
     atomic {
       if
       :: st == OK -> mycount[c]++; confirmed(c, sent, INNER_TTL)
       :: st == GONE || st == TAKEN -> lost[c] = true   /* the loss is reported */
       :: else -> skip
       fi;
#ifndef BEYOND_BOUND
       /* a re-entry keeps its hold (same fence) or reports the loss: a hold never
        * changes behind its holder's back */
       assert(lost[c] || (st == OK && v == myfence[c]))
#endif
     }
  :: else -> skip
  fi;
  /* the body: write to the resource while it believes it holds the lock */
  if
  :: alive[c] = false; in_cs[c] = false; goto done   /* killed in the body */
  :: !lost[c] ->
     atomic {
#ifndef NO_FENCE_CHECK
       if
       :: myfence[c] >= res_max ->
#endif
          assert(myfence[c] >= res_last);   /* accepted writes carry rising fences */
          res_last = myfence[c];
          if
          :: myfence[c] > res_max -> res_max = myfence[c]
          :: else -> skip
          fi
#ifndef NO_FENCE_CHECK
       :: else -> skip                          /* a stale writer is refused */
       fi
#endif
     }
  :: lost[c] -> skip
  fi;
  in_cs[c] = false;
  /* release every acquire */
  do
  :: mycount[c] > 0 ->
     call(c, REL, op, myfence[c], st, v, false);   /* names its hold's fence */
     atomic {
       mycount[c]--;
       if
       :: (st == GONE || st == TAKEN) && !lost[c] ->
          /* a release is reported lost only when the hold did end otherwise (or,
           * for a re-sent final release, when a later hold has ended since its
           * first execution: the documented bound of the counter's memory) */
          assert(gone_by_loss[c] || ended_since[c]);
          lost[c] = true  /* LockLost */
       :: else -> skip
       fi;
       if
       :: st == OK && !lost[c] ->
#ifndef BEYOND_BOUND
          /* the server's count follows ours exactly */
          assert(v == mycount[c])
#else
          skip
#endif
       :: else -> skip
       fi
     }
  :: mycount[c] == 0 -> break
  od;
  held[c] = false;
done:
  alive[c] = false
}

/* Time may not pass a live hold's deadline + PAUSE until its watchdog has told it:
 * the bounded-pause assumption. */
#ifdef NO_DEADLINE
#define OVERDUE(c) false  /* no watchdog: nothing to wait for */
#elif defined(WATCHDOG_IN_RENEWER)
/* the watchdog cannot run while its loop waits for a renewal: time goes on */
#define OVERDUE(c) (held[c] && alive[c] && !lost[c] && !waiting[c] \
                    && now >= deadline[c] + PAUSE)
#else
#define OVERDUE(c) (held[c] && alive[c] && !lost[c] && now >= deadline[c] + PAUSE)
#endif

proctype Clock() {
  do
  :: atomic { (now < MAXT && !OVERDUE(1) && !OVERDUE(2)) -> now++ }
  :: now == MAXT -> break
  od
}

/* Scenarios (-DLOST_REPLIES: each client may lose one reply; without it, none). */
init {
  atomic {
    alive[1] = true; alive[2] = true;
#ifdef LOST_REPLIES
    drop_budget[1] = true; drop_budget[2] = true;
#endif
    run Server();
    run Renewer(1); run Renewer(2);
#ifndef WATCHDOG_IN_RENEWER
    run Watchdog(1); run Watchdog(2);
#endif
#ifdef RENEW_HANG
    renew_drop[1] = true; renew_drop[2] = true;
#endif
#if defined(FORCE) || defined(DATA_LOSS)
    run Operator();
#endif
    run Client(1, true); run Client(2, false);
    run Clock()
  }
}
