/*
 * celery-dlock's lock protocol, as implemented (celery_dlock/redis/scripts.py,
 * redis/lock.py, core/heartbeat.py, core/deadline.py), checked with spin.  See
 * docs/protocol.md for the prose.
 *
 * Two clients (owners 1 and 2) each take one lock (possibly re-entering it), write to a
 * fenced resource while they believe they hold it, and release.  A heartbeat renews
 * each hold; a watchdog tells its client at the hold's local deadline.  The server runs
 * each script atomically.  Time is a tick counter.
 *
 * Faults: the reply of any acquire or release may be lost once per client (the client
 * re-sends the same operation id, as redis-py's Retry does); requests (renewals
 * included) and replies are delayed while time passes; a client may die at any step (its hold then expires); the server's clock may
 * run DRIFT ticks ahead of the client's over a ttl; the watchdog may be paused up to
 * PAUSE ticks.
 *
 * Switches (pass with spin -D...), each a mutant that must produce a counterexample:
 *   NO_OPID       the scripts ignore operation ids (a re-sent call runs twice)
 *   NO_DEADLINE   no watchdog: a hold is lost only when a renewal reply says so
 *   SHORTEN       re-entry and renewal set the expiry even when that brings it closer
 *   NO_FENCE_CHECK the resource accepts every write
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
#define GRACE 1           /* a woken waiter's grace (WAKE_GRACE) */
#define NONE 0

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
byte s_lastop[3];        /* last operation id applied per owner (ops field) */
byte s_tomb[3];          /* op id of the final release that freed it, per owner (:r:OP) */
byte s_waiter = NONE;    /* the first in line */
byte s_promise_end = 0;  /* a free lock is promised to s_waiter until then */

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

chan req = [4] of { byte, byte, byte, byte, byte };  /* client, kind, op id, send time, ttl */
chan rep[3] = [1] of { byte, byte };           /* status, value: to the client */
chan hbrep[3] = [1] of { byte };               /* status: to its heartbeat */
bool dropped[3];         /* the reply of the client's last request was lost */

inline expire() {
  if
  :: s_owner != NONE && now >= s_expiry -> s_owner = NONE; s_count = 0
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

proctype Server() {
  byte c, kind, op, sent, ttl;
  byte other, before;
end_server:
  do
  :: req?c, kind, op, sent, ttl ->
     atomic {
       expire();
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
          :: s_owner == NONE && (s_waiter == NONE || s_waiter == c
                                 || now >= s_promise_end) ->
             /* told first: nobody else still believes it may write */
#ifndef BEYOND_BOUND
             assert(!(in_cs[other] && alive[other] && !lost[other]));
#endif
             fence_ctr++;
             s_owner = c; s_count = 1; s_fence = fence_ctr; s_lastop[c] = op;
             s_expiry = now + ttl - DRIFT;
             if
             :: s_waiter == c || now >= s_promise_end -> s_waiter = NONE
             :: else -> skip
             fi;
             reply(c, OK, s_fence)
          :: else ->
             s_waiter = c;                            /* joins the line */
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
                   s_owner = NONE; s_tomb[c] = op;
                   if
                   :: s_waiter != NONE -> s_promise_end = now + GRACE  /* ring */
                   :: else -> skip
                   fi
                :: else -> skip
                fi;
                reply(c, OK, s_count)
#ifndef NO_OPID
             fi
#endif
          :: else ->
#ifndef NO_OPID
             if
             :: s_tomb[c] == op -> reply(c, OK, 0)          /* re-sent final release */
             :: else -> reply(c, GONE, 0)
             fi
#else
             reply(c, GONE, 0)
#endif
          fi
       :: kind == REN ->
          if
          :: s_owner == c -> extend_to(now + TTL - DRIFT); hbrep[c]!OK
          :: s_owner == NONE -> hbrep[c]!GONE
          :: else -> hbrep[c]!TAKEN
          fi
       fi
     }
  od
}

/* Send a request and wait for its reply, re-sending (same op id) when it was lost. */
inline call(c, kind, op, ttl, st, v) {
  atomic { op++; sent = now; dropped[c] = false; req!c, kind, op, sent, ttl };
  do
  :: rep[c]?st, v -> break
  /* the re-send keeps the first send time: the reply may confirm the first execution */
  :: atomic { dropped[c] -> dropped[c] = false; req!c, kind, op, sent, ttl }
  od
}

inline confirmed(c, t, ttl) {
  if
  :: t + ttl - MARGIN > deadline[c] -> deadline[c] = t + ttl - MARGIN
  :: else -> skip
  fi
}

proctype Heartbeat(byte c) {
  byte st, v, sent, ttl;
  byte last = 255;
end_hb:
  do
  :: atomic { (alive[c] && held[c] && !lost[c] && now + RENEW_AHEAD >= deadline[c] && now != last) ->
       /* renewal falls due (ttl/3 before the end, in ticks) */
       last = now; sent = now; req!c, REN, 0, sent, TTL };
     hbrep[c]?st;        /* a late reply is a late confirmation, or none in time */
     atomic {
       if
       :: st == OK && held[c] && !lost[c] -> confirmed(c, sent, TTL)
       :: st != OK && held[c] -> lost[c] = true
       :: else -> skip
       fi
     }
#ifndef NO_DEADLINE
  :: atomic { held[c] && !lost[c] && now >= deadline[c] -> lost[c] = true }
#endif
  :: !alive[c] -> break
  od
}

proctype Client(byte c; bool reenter) {
  byte st, v, sent;
  byte op = c * 10;
  byte tried, tries = 0;
  bool late;
  /* acquire, waiting in line */
  do
  :: call(c, ACQ, op, TTL, st, v);
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
           call(c, REL, op, TTL, st, v);          /* too late to vouch for: give back */
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
  :: reenter ->
     /* re-entry with a shorter ttl (an inner lock object with its own ttl) */
     call(c, ACQ, op, INNER_TTL, st, v);
#ifndef BEYOND_BOUND
     /* a live hold re-enters: same fence; only a hold already told lost may not */
     assert(lost[c] || (st == OK && v == myfence[c]));
#endif
     atomic {
       if
       :: st == OK -> mycount[c]++; confirmed(c, sent, INNER_TTL)
       :: else -> skip
       fi
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
     call(c, REL, op, TTL, st, v);
     atomic {
       mycount[c]--;
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
    run Heartbeat(1); run Heartbeat(2);
    run Client(1, true); run Client(2, false);
    run Clock()
  }
}
